import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    from tests.tiny import write_model

    return write_model(tmp_path_factory.mktemp("target"), seed=0)


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory):
    from tests.tiny import write_model

    return write_model(tmp_path_factory.mktemp("draft"), layers=1, hidden=32, seed=1)
