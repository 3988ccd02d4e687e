"""``python -m klear.integrations.verl``: import verl (which loads its plugins) and check klear's plugin loaded."""

from __future__ import annotations

import sys


def main() -> int:
    """Exit 0 and say so when verl's registries hold klear's losses and trainer; else print why and exit 1."""
    import verl

    from klear.integrations.verl import check_plugin

    try:
        check_plugin()
    except RuntimeError as e:
        print(f"klear verl plugin: {e}", file=sys.stderr)
        return 1
    print(f"klear verl plugin loaded (verl {verl.__version__}): losses gppo, gppo_only_high; trainer klear_sync")
    return 0


if __name__ == "__main__":
    sys.exit(main())
