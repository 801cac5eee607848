"""kvserve's serving benchmark and load generator (see docs/loadtest.md)."""
