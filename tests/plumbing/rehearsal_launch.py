"""torchrun entry point of tests/plumbing/test_rehearsal.py: train.main(argv), as `train.py` runs,
with RM-NLHF's verdicts forced when REHEARSAL_FORCE_VERDICTS is set (test_e2e_nlhf.force_verdicts:
a random tiny GRM never writes a verdict, so without it every reward is -1, nothing moves and
neither the judge nor the MetaRM's online update would run on any rank)."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [REPO, os.path.join(REPO, "tests"), HERE, os.path.join(REPO, "tests", "algorithm")]

if __name__ == "__main__":
    import train
    if os.environ.get("REHEARSAL_FORCE_VERDICTS"):
        import pytest
        from test_e2e_nlhf import force_verdicts, load_pairs
        force_verdicts(pytest.MonkeyPatch(), load_pairs())
    train.main(sys.argv[1:])
