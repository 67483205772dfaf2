"""sweep.py's early stopping: Ray Tune's ASHA, within each subject.

Tune's ASHAScheduler compares every trial with every other; in a sweep of several subjects a
trial must only be compared with the trials of its own subject (their scores are on different
scales). SubjectASHA keeps one ASHAScheduler per subject (the trial config's "subject") and hands
each trial's events to its subject's. It imports Ray Tune: import it only where a sweep runs.
"""

from ray.tune.schedulers import ASHAScheduler
from ray.tune.schedulers import FIFOScheduler


class SubjectASHA(FIFOScheduler):
    """ASHA (time_attr, metric, mode, max_t, grace_period, reduction_factor: ASHAScheduler's) run
    separately for the trials of each subject; trials start in submission order (FIFO)."""

    def __init__(self, **asha):
        super().__init__()
        self.asha = asha
        self.by_subject = {}

    def of(self, trial):
        subject = trial.config.get("subject")
        if subject not in self.by_subject:
            self.by_subject[subject] = ASHAScheduler(**self.asha)
        return self.by_subject[subject]

    def on_trial_add(self, tune_controller, trial):
        self.of(trial).on_trial_add(tune_controller, trial)

    def on_trial_result(self, tune_controller, trial, result):
        return self.of(trial).on_trial_result(tune_controller, trial, result)

    def on_trial_complete(self, tune_controller, trial, result):
        self.of(trial).on_trial_complete(tune_controller, trial, result)

    def on_trial_remove(self, tune_controller, trial):
        self.of(trial).on_trial_remove(tune_controller, trial)

    def on_trial_error(self, tune_controller, trial):
        self.of(trial).on_trial_error(tune_controller, trial)

    def debug_string(self):
        return f"ASHA within each of {len(self.by_subject)} subject(s)."
