"Hermetic test session: offline hub, a probe cache of its own (never the user's ~/.cache/diffq_lab), one torch thread."
import os, tempfile
import pytest
import torch

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ['DIFFQ_LAB_CACHE'] = tempfile.mkdtemp(prefix='diffq_lab_test_cache_')

@pytest.fixture(autouse=True, scope='session')
def one_thread():
    "Tiny models run 10-70x slower when torch's threads contend for a busy 2-core machine's cores."
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
