"""Packages import one way, from the bottom up (the layers of docs/architecture.md)."""

from onegpu.tools import layers


def test_every_import_points_down_the_layers():
    edges = layers.package_imports()
    assert layers.violations(edges) == []
    # no two packages import each other (implied by strict layers, checked outright)
    for src, dsts in edges.items():
        for dst in dsts:
            assert src not in edges.get(dst, {}), (src, dst)


def test_every_package_has_a_layer():
    packages = {
        p.name for p in layers.ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()
    }
    modules = {p.stem for p in layers.ROOT.glob("*.py") if p.stem != "__init__"}
    assert packages | modules == set(layers.LAYER_OF)


def test_the_checker_sees_a_wrong_way_import():
    edges = {"config": {"build": {"onegpu.config"}}, "build": {"config": {"onegpu.build"}}}
    found = layers.violations(edges)
    assert len(found) == 1 and found[0].startswith("config (layer 0) imports build")
