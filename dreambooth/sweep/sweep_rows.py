"""The sweep's results as typed rows: one TrialRow per (trial, step count) scored and per failed
trial, collected from Tune's results; how trials rank (DINO gain over the base model, against the
held-out photos with --holdout, CLIP-T kept within a margin), and each subject's Choice.
"""

import dataclasses

from dreambooth.evaluation import scores
from dreambooth.evaluation.scores import ranking_key

METRICS = ("dino", "clip_i", "clip_t", "div", "pres", *scores.HOLDOUT_NAMES)


@dataclasses.dataclass(frozen=True)
class TrialRow:
    """A trial's scores at one step count, or (status "failed: <cause>", no step) a failed trial."""

    subject: str
    learning_rate: float
    train_text_encoder: bool
    rank: int = None  # the LoRA rank; None for a full fine-tune
    step: int = None
    model: str = None  # the scored model's folder (LoRA: its adapters')
    dino: float = None
    clip_i: float = None
    clip_t: float = None
    div: float = None
    pres: float = None
    dino_holdout: float = None  # --holdout: against the photos every trial was trained without
    clip_i_holdout: float = None
    status: str = "ok"
    note: str = None  # e.g. "stopped early at step 2 (behind the others there)"

    @property
    def scored(self):
        return self.status == "ok"

    def config(self):
        """The row's trial settings as Tune's trial config names them (sweep_trial.trial_label's)."""
        return {"subject": self.subject, "learning_rate": self.learning_rate, "train_text_encoder": self.train_text_encoder,
                "use_lora": self.rank is not None, "rank": self.rank}

    def scores(self):
        """{metric: value} of the row (evaluate.py's overall names)."""
        return {name: getattr(self, name) for name in METRICS}


@dataclasses.dataclass(frozen=True)
class Choice:
    """A subject's best row: the highest DINO (ranked_by) among those with CLIP-T within the margin
    of the base model's (within_margin), else the highest DINO of all, flagged."""

    row: TrialRow
    within_margin: bool
    ranked_by: str  # "dino", or "dino_holdout" with --holdout


def collect(results, last_step=None):
    """TrialRows of Tune's results: one per (trial, step count) scored, one per failed trial. A trial
    whose last score is before last_step (the largest step count) without an error was stopped early:
    its last row says so."""
    rows = []
    for result in results:
        config = result.config
        settings = dict(subject=config["subject"], learning_rate=config["learning_rate"],
                        train_text_encoder=config["train_text_encoder"],
                        rank=config["rank"] if config.get("use_lora") else None)  # full fine-tuning has none
        frame = result.metrics_dataframe
        scored = frame.to_dict("records") if frame is not None and "dino" in frame else []
        for record in scored:
            rows.append(TrialRow(**settings, step=int(record["step"]), model=record["model"],
                                 **{k: record.get(k) for k in METRICS}))
        if scored and result.error is None and last_step and rows[-1].step < last_step:
            rows[-1] = dataclasses.replace(rows[-1], note=f"stopped early at step {rows[-1].step} "
                                                          "(behind the others there)")
        if result.error is not None:
            reason = str(result.error).strip().splitlines()
            rows.append(TrialRow(**settings, status="failed: " + (reason[-1] if reason else
                                                                  type(result.error).__name__)))
    return rows


def ranking_dino(scores):
    """The DINO one set of scores ({metric: value}) ranks by (ranking_key)."""
    return scores[ranking_key([scores])]


def rank_score(overall, clip_t_floor, base_dino):
    """What ASHA compares trials by: the DINO gain over the subject's base model (DINO against held-out
    photos with --holdout), less 1 when CLIP-T fell below clip_t_floor (the base model's minus the
    margin: a model that forgot the prompt ranks under every one that kept it)."""
    gain = ranking_dino(overall) - base_dino
    return gain - 1.0 if clip_t_floor is not None and overall["clip_t"] < clip_t_floor else gain


def choose(rows, base, margin):
    """{subject: Choice}: highest DINO with CLIP-T >= the base's minus margin (else highest DINO,
    flagged). With --holdout, DINO against the held-out photos: a model that copies its training
    photos does not win."""
    best = {}
    for subject in base:
        scored = [r for r in rows if r.subject == subject and r.scored]
        if scored:
            index, within, key = scores.best_of({i: r.scores() for i, r in enumerate(scored)},
                                                base[subject]["clip_t"] - margin)
            best[subject] = Choice(scored[index], within, key)
    return best
