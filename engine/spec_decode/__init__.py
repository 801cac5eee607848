"""Speculative decoding: proposers (n-gram, draft model) on the scheduler's side, scoring of every
draft position on the runner's side."""
