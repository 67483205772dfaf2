"""A new family with a base model of its own, added to a copy of the package: its short name in --help and its column
in the memory table, read by new processes."""

import os
import shutil

from support import NEW_FAMILY

PEN_KNOWN = '''
    known_models = (known.KnownModel("sd1-pen", "someone/sd1-penultimate", "0" * 40, 512, "epsilon", 4.3),)
'''


def test_a_new_familys_short_name_and_memory_column_come_with_its_module_and_table_entry(tmp_path):
    """The same new family in a copy of the package, its module naming one base model by short name: --help lists
    the short name, the model is known by it, and docs/MEMORY.md's table has the family's column (the released
    parameter counts it inherits from SD 1.x), with nothing else in the package touched but the table's entry."""
    import subprocess
    import sys

    from dreambooth.files import REPO_DIR

    shutil.copytree(os.path.join(REPO_DIR, "dreambooth"), tmp_path / "dreambooth",
                    ignore=shutil.ignore_patterns("__pycache__"))
    module = NEW_FAMILY.replace("from dreambooth.families import family_sd1\n",
                                "from dreambooth.families import family_sd1\nfrom dreambooth.families import known\n")
    module = module.replace("        return text_encoders[0](ids, output_hidden_states=True).hidden_states[-2], None\n",
                            "        return text_encoders[0](ids, output_hidden_states=True).hidden_states[-2], None\n"
                            + PEN_KNOWN)
    (tmp_path / "dreambooth" / "families" / "family_penultimate.py").write_text(module)
    table = tmp_path / "dreambooth" / "families" / "__init__.py"
    text = table.read_text()
    entry = "family_chroma.FAMILY)}"
    assert entry in text
    table.write_text(text.replace(entry, "family_chroma.FAMILY, family_penultimate.FAMILY)}").replace(
        "from dreambooth.families import family_flux\n",
        "from dreambooth.families import family_flux\nfrom dreambooth.families import family_penultimate\n"))
    probe = ("from dreambooth.commands import cache_model; from dreambooth.models import known_models; "
             "from dreambooth.planning import memory; from dreambooth.config import flags; "
             "print(known_models.known_model('someone/sd1-penultimate').family); "
             "print(flags.FLAGS['model_name'][1]['help']); print(memory.table().splitlines()[0])")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(tmp_path)), check=True).stdout.splitlines()
    assert out[0] == "sd1-penultimate"
    assert "sd1-pen" in out[1].split("(")[1].split(";")[0].split(", ")  # the short names, as the families list them
    assert "SD 1.x (penultimate layer), 512 px" in out[2]
