"""`python -m pdgate.sim`: the same as the `pdgate-sim` command."""

from pdgate.sim.app import main

if __name__ == "__main__":
    main()
