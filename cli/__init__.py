"""`pdgate`: the operator's command (instances, handoffs, drain, top, doctor). Start at main.py."""
