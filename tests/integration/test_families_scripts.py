"""A family is one folder that registers itself: one family's folder copied under a new name into a copy of the
package, its own names changed inside it, is a family of the suite in new processes, with no other file edited."""

import os
import re
import shutil
import subprocess
import sys

from dreambooth.files import REPO_DIR

PROBE = r"""
import contextlib, io, json, sys
from dreambooth import families
from dreambooth.commands import cache_model, export
from dreambooth.config import flags
from dreambooth.planning import memory

def help_of(main):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main(["--help"])
    return " ".join(out.getvalue().split())

model = cache_model.main(["--model_dir", sys.argv[1], "--tiny", "--arch", "chroma2"])
print(json.dumps({"archs": list(families.ARCHS), "cache_model": help_of(cache_model.main),
                  "export": help_of(export.main), "model_name": flags.FLAGS["model_name"][1]["help"],
                  "memory": memory.flow_table(), "model": json.load(open(model + "/model_index.json"))["_class_name"],
                  "known": [m.family for m in families.KNOWN_MODELS if m.short_name == "chroma2"]}))
"""


def test_a_family_folder_copied_under_a_new_name_is_a_family_of_every_script(tmp_path):
    """families/chroma copied as families/chroma2 in a copy of the package, with its label, short name, hub name
    and own size renamed inside the folder: cache_model.py builds its tiny model (--arch chroma2) and lists it in
    --help, the short name is known and listed, the memory table has its rows and export.py's --help names it
    among the families whose adapters it writes; nothing outside the new folder changed."""
    import json

    package = tmp_path / "dreambooth"
    shutil.copytree(os.path.join(REPO_DIR, "dreambooth"), package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(package / "families" / "chroma", package / "families" / "chroma2")
    copy = package / "families" / "chroma2" / "__init__.py"
    text = copy.read_text()
    renamed = re.sub(r'"Chroma"', '"Chroma 2"', re.sub(r'"chroma"', '"chroma2"', text)).replace(
        "lodestones/Chroma1-HD", "someone/Chroma2")
    assert renamed.count("chroma2") >= 3 and "Chroma 2" in renamed  # (own size, released size, short name; label)
    copy.write_text(renamed)
    proc = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "cache")], cwd=tmp_path, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(tmp_path), HF_HUB_OFFLINE="1"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    at = out["archs"].index("chroma")
    assert out["archs"][at:at + 2] == ["chroma", "chroma2"]  # (in the families' order: its copy's, then by name)
    assert "chroma2 (Chroma 2, Chroma's layout" in out["cache_model"] and out["model"] == "ChromaPipeline"
    assert out["known"] == ["chroma2"] and "chroma2" in out["model_name"]
    assert "| Chroma 2, 512 |" in out["memory"] and "Chroma, Chroma 2" in out["export"]
