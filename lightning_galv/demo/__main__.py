"""``python -m lightning_galv.demo``: the main job (see :mod:`lightning_galv.demo.run`)."""

from .run import main

if __name__ == "__main__":
    main()
