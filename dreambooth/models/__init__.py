"""Where models come from and how they load: the model cache, known short names, random models, loading and training set-up, quantised and sharded denoisers, train.py's output folders."""
