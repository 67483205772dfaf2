"""The scripts' main()s, one module per script (train.py runs commands/train.py's main); they call the layers below, never each other."""
