"""Ray Tune sweeps (sweep.py): a trial's training and scoring, the sweep's files, rows, report and early-stopping scheduler."""
