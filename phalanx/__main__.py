"""``python -m phalanx``: the phalanx command line."""

from phalanx.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
