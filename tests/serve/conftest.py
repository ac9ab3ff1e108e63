import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the helpers next to the tests (fake_model, server_thread)
