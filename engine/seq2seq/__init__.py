"""Encoder-decoder models' side of the engine core: the cross-attention blocks that hold each source's
encoder output (`CrossCache`), which the scheduler calls only when the model is an encoder-decoder.
Plain Python, no torch; the model files themselves are in models/seq2seq.py."""
