"Hermetic test session: offline hub, and a probe cache of its own (never the user's ~/.cache/diffq_lab)."
import os, tempfile

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ['DIFFQ_LAB_CACHE'] = tempfile.mkdtemp(prefix='diffq_lab_test_cache_')
