"""The repository's own checks of its code (pyproject.toml): ruff, and the import contracts that keep the
package's layers (lower modules never import higher ones; families know nothing of training and never import one
another), which fail on an upward import and a family's import of another planted in a copy of the package; and no
import circle anywhere in the package."""

import os
import shutil
import subprocess
import sys

from dreambooth.files import REPO_DIR

REPO = REPO_DIR
LINT_IMPORTS = os.path.join(os.path.dirname(sys.executable), "lint-imports")


def test_ruff_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]


def lint_imports(folder):
    return subprocess.run([LINT_IMPORTS, "--no-cache"], cwd=folder, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=folder))


def test_the_import_contracts_hold_with_no_circle_and_an_upward_import_breaks_them(tmp_path):
    kept = lint_imports(REPO)
    assert kept.returncode == 0 and "4 kept, 0 broken" in kept.stdout, kept.stdout[-3000:]
    # A copy of the package where errors (a bottom layer) imports train (a command), a family imports steps and
    # another family, and one command imports another.
    shutil.copytree(os.path.join(REPO, "dreambooth"), tmp_path / "dreambooth",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(REPO, "pyproject.toml"), tmp_path)
    with open(tmp_path / "dreambooth" / "errors.py", "a") as f:
        f.write("\n\ndef planted():\n    from dreambooth.commands import train  # noqa: F401\n")
    with open(tmp_path / "dreambooth" / "families" / "sd1" / "__init__.py", "a") as f:
        f.write("\n\ndef planted():\n    from dreambooth.training import steps  # noqa: F401\n"
                "    from dreambooth.families import sd2  # noqa: F401\n")
    with open(tmp_path / "dreambooth" / "commands" / "generate.py", "a") as f:
        f.write("\n\ndef planted():\n    from dreambooth.commands import train  # noqa: F401\n")
    broken = lint_imports(str(tmp_path))
    assert broken.returncode != 0 and "0 kept, 4 broken" in broken.stdout, broken.stdout[-3000:]
    assert "dreambooth.errors -> dreambooth.commands.train" in broken.stdout
    assert "dreambooth.families.sd1 -> dreambooth.training.steps" in broken.stdout
    assert "dreambooth.families.sd1 is not allowed to import dreambooth.families.sd2" in broken.stdout
    assert "dreambooth.commands.generate -> dreambooth.commands.train" in broken.stdout
    assert import_circles(REPO) == [] and ("dreambooth.errors", "dreambooth.commands.train") in import_circles(str(tmp_path))


CIRCLES = """
import json, grimp
graph = grimp.build_graph("dreambooth")
print(json.dumps(sorted([module, imported] for module in graph.modules
                        for imported in graph.find_modules_directly_imported_by(module)
                        if imported != module and graph.chain_exists(imported, module))))
"""


def import_circles(folder):
    """(module, module it imports) pairs of the package in folder where the second imports the first back,
    directly or through others."""
    import json

    proc = subprocess.run([sys.executable, "-c", CIRCLES], cwd=folder, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=folder), check=True)
    return [tuple(pair) for pair in json.loads(proc.stdout)]


