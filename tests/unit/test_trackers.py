"""--report_to's W&B and MLflow runs read back from their own files, and --notify_url's messages as a
local webhook server receives them."""

import json
import os

import pytest
from trackerfiles import Webhook

from dreambooth import errors
from dreambooth.planning import planning
from dreambooth.storage import notify
from dreambooth.training import trackers


def test_notify_posts_json_that_slack_and_discord_read_and_never_says_the_url(webhook, capsys):
    assert notify.send(webhook.url, "finished", "run r finished", run="r", loss=0.25)
    path, body = webhook.received[0]
    assert path == "/hooks/secret-part"
    assert body == {"text": "run r finished", "content": "run r finished", "event": "finished", "run": "r",
                    "loss": 0.25}
    assert notify.body("https://hooks.slack.com/services/T/B/x", "failed", "t", {"cause": "c"}) == {"text": "t"}
    assert notify.body("https://discord.com/api/webhooks/1/x", "failed", "t", {"cause": "c"}) == {"content": "t"}
    # A webhook that refuses, or nothing listening: one warning line naming the host only, the run goes on.
    refusing = Webhook(status=403)
    try:
        assert not notify.send(refusing.url, "started", "x")
    finally:
        refusing.close()
    assert not notify.send(webhook.url.replace(str(webhook.server.server_port), "9"), "started", "x")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all("127.0.0.1" in line and "secret-part" not in line for line in err), err
    assert "403" in err[0]
    assert notify.send(None, "started", "x") is False  # no URL: nothing sent, nothing said


def test_notify_url_is_http_and_never_written_to_the_runs_settings():
    argv = ["--model_dir", "/m", "--output_dir", "/o", "--instance_data_dir", "/i", "--instance_prompt", "x"]
    args = planning.parse_args(argv + ["--notify_url", "https://hooks.slack.com/services/T/B/secret",
                                       "--report_to", "all"])
    assert args.notify_url.endswith("/secret") and "secret" not in args.settings_toml
    assert trackers.chosen(args.report_to) == trackers.TRACKERS
    with pytest.raises(SystemExit):
        planning.parse_args(argv + ["--notify_url", "file:///etc/passwd"])


def test_a_missing_tracker_package_is_one_line_with_the_pip_command(monkeypatch):
    monkeypatch.setitem(trackers.PACKAGES, "wandb", ("wandb_not_installed_here", "wandb"))
    with pytest.raises(errors.UserError, match=r"^--report_to wandb needs the wandb_not_installed_here package: "
                                              r"pip install wandb$"):
        trackers.check_installed("all")
    trackers.check_installed("mlflow")  # (installed here: requirements-dev.txt)


def test_wandb_goes_offline_without_a_key(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert trackers.wandb_mode() == ("offline", "no W&B API key")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert trackers.wandb_mode() == ("disabled", "WANDB_MODE")
    # A key, but the host cannot be reached (a closed port on this machine): offline too.
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    assert trackers.wandb_mode() == ("offline", "127.0.0.1:9 cannot be reached")


def test_a_run_going_on_from_a_checkpoint_keeps_the_rows_until_it_and_loss_png_shows_the_whole_run(tmp_path):
    """Resumed into a new run folder: the stopped run's rows up to the checkpoint come first (loss.png once
    showed only the resumed half). A restarted worker group in its own folder: the rows its dead group logged
    after the checkpoint go (they are logged again; the plot zigzagged)."""
    from dreambooth.training import runlog

    def rows(folder, steps=None):
        path = tmp_path / folder / runlog.METRICS_FILE
        if steps is not None:
            (tmp_path / folder).mkdir()
            path.write_text("".join(json.dumps({"step": s, "loss": s / 10, "lr": 1e-5}) + "\n" for s in steps))
        return [json.loads(line)["step"] for line in path.read_text().splitlines()]

    rows("stopped", [2, 4, 6])
    (tmp_path / "resumed").mkdir()
    runlog.keep_rows_until(4, str(tmp_path / "resumed" / runlog.METRICS_FILE), str(tmp_path / "stopped"))
    assert rows("resumed") == [2, 4] and rows("stopped") == [2, 4, 6]
    rows("restarted", [2, 4, 6, 8])
    runlog.keep_rows_until(4, str(tmp_path / "restarted" / runlog.METRICS_FILE), str(tmp_path / "stopped"))
    assert rows("restarted") == [2, 4]
    runlog.keep_rows_until(0, str(tmp_path / "restarted" / runlog.METRICS_FILE))  # restarted from the start
    assert rows("restarted") == []
    (tmp_path / "fresh").mkdir()  # nothing to go on from: no file
    runlog.keep_rows_until(4, str(tmp_path / "fresh" / runlog.METRICS_FILE), str(tmp_path / "none-here"))
    assert os.listdir(tmp_path / "fresh") == []


