"""Every command-line flag of the suite, defined once: the table, its types, the help formatter and
--config files are dreambooth/config/flags.py; this module hands them on under the name Ray's example uses.

    python flags.py    lists every flag with its help; each script's --help shows its own
"""

import textwrap

from dreambooth.config import flags
from dreambooth.config.flags import *  # noqa: F401,F403


def main():
    for options, kwargs in flags.FLAGS.values():
        print(", ".join(options))
        print(textwrap.fill(kwargs.get("help", ""), width=100, initial_indent="    ", subsequent_indent="    "))


if __name__ == "__main__":
    main()
