"""Build the CUDA extension ahead of time: `python -m nvfp4_dist.build` (see nvfp4_dist/_extension.py)."""
import argparse
import logging

from ._extension import load_extension


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quiet", action="store_true", help="hide the compiler commands")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    module = load_extension(verbose=not args.quiet)
    print(f"nvfp4_dist._C built: {module.__file__}")


if __name__ == "__main__":
    main()
