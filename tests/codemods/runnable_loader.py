"""Loading a runnable fixture (or its rewrite) by path, under a name of its own, inside a world."""

import importlib.util
import pathlib


def load_fixture(path: str):
    spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem + "_loaded", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
