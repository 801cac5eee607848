"""Structured outputs: grammars compiled off the step loop, one matcher per sequence, bounds on
what the compiler is given."""
