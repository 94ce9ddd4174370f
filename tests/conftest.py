"""Test isolation: Prefect results, Prefect home and the MLflow store go to a temporary folder.

Set before anything imports prefect or mlflow (pytest imports conftest first).
"""

import os
import tempfile
from pathlib import Path

import pytest

_TMP = Path(tempfile.mkdtemp(prefix="bayesq-tests-"))
os.environ["PREFECT_HOME"] = str(_TMP / "prefect")
os.environ["PREFECT_LOCAL_STORAGE_PATH"] = str(_TMP / "prefect" / "results")
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_TMP / 'mlflow.db'}"
from flows.settings import apply_defaults  # noqa: E402

apply_defaults()  # the pipeline's other settings (offline, quiet), as its entry points set them


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


if _no_cuda():  # Triton kernels run in its interpreter on CPU; read when a kernel is first defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):  # one of several worker processes: one core each
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def prefect_harness():
    """One temporary Prefect server for every flow test of the session (of the xdist worker).

    Its address is also put in the environment, so flow processes a test starts (``python -m
    flows.zoo``, Dask workers) use it instead of each starting a temporary server of their own
    (about 25 s each on two busy cores)."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        old = os.environ.get("PREFECT_API_URL")
        os.environ["PREFECT_API_URL"] = PREFECT_API_URL.value()
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("PREFECT_API_URL", None)
            else:
                os.environ["PREFECT_API_URL"] = old


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add contention on a busy machine; restored after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def byo_models(tmp_path_factory):
    """Tiny Hugging Face folders and a torchvision checkpoint, as a user brings them (tests/byo_fixtures.py)."""
    from tests.byo_fixtures import make_models

    return make_models(tmp_path_factory.mktemp("byo-models"))


@pytest.fixture(scope="session")
def byo_data(tmp_path_factory):
    """Sentences and images in every supported format (tests/byo_fixtures.py)."""
    from tests.byo_fixtures import make_data

    return make_data(tmp_path_factory.mktemp("byo-data"))
