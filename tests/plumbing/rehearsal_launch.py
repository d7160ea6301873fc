"""torchrun entry point of tests/plumbing/test_rehearsal.py: train.main(argv), as `train.py` runs,
with RM-NLHF's verdicts forced when REHEARSAL_FORCE_VERDICTS is set (test_e2e_nlhf.force_verdicts:
a random tiny GRM never writes a verdict, so without it every reward is -1, nothing moves and
neither the judge nor the MetaRM's online update would run on any rank). In-run validation
(nlhf.val, LLMBar in test_configs.swaps) goes through the same generate, so its pairs are known too."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [REPO, os.path.join(REPO, "tests"), HERE, os.path.join(REPO, "tests", "algorithm")]

def main(argv):
    import train
    if os.environ.get("REHEARSAL_FORCE_VERDICTS"):
        import pytest
        from conftest import data_path
        from plumbing.pairwise import load_pairwise
        from test_e2e_nlhf import force_verdicts, load_pairs
        # + the validation pairs test_configs.swaps reads (nlhf.val), whose prompts go through the same generate
        val = [dict(it, critique=None) for it in load_pairwise(data_path("llmbar", "LLMBar_Natural.jsonl"), seed=0)]
        force_verdicts(pytest.MonkeyPatch(), load_pairs() + val)
    train.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
