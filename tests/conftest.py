"""Test order for pytest-xdist (CI: `-n auto --dist loadgroup` on 2 cores).

The tests marked `slow` (a minute or so of a core each: toolchain compile checks,
subprocesses with several host devices, whole-model decodes) are moved to the front,
in collection order, so that they start first and the short tests fill in around
them; a worker left running one long test alone at the end would set the suite's
wall time. Under `--dist loadgroup` a module whose expensive module fixture must run
once (`pytest.mark.xdist_group`) is one work unit, and xdist starts the largest
units first."""


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable
