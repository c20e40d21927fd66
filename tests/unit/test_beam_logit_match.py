"""The A/B harness compares beam search's logits beam by beam: rows matched by token history.

Each run of beam search orders its beams itself, and a near-tie of two candidates' scores can put
a different candidate in a beam; comparing row i with row i then compares two different beams'
logits (tens of logits apart) although the returned sequences are equal. These specs build the
two runs by hand (exact ids), so the matching is checked without a model.
"""

from __future__ import annotations

import torch

from hf_vkv.ab.harness import _compare, _Run
from hf_vkv.ab.probes import StepProbe


def _run(histories: list[list[list[int]]], logits: list[torch.Tensor], *, record: bool = True) -> _Run:
    probe = StepProbe(cache=None, histories=record)  # type: ignore[arg-type]  (no cache: kv_bytes is not called)
    for ids in histories:
        t = torch.tensor(ids)
        probe.times.append(0.0)
        probe.kv_bytes.append(0)
        probe.last_ids.append(t[:, -1].clone())
        if probe.histories is not None:
            probe.histories.append(t)
    sequences = torch.tensor([row + [9] for row in histories[-1]])
    return _Run(sequences=sequences, logits=logits, probe=probe, tee=None, wall_s=0.0, final_kv_bytes=0)


# step 0: three beams of one prompt [1, 2]; step 1: the beams hold three different histories
REF_IDS = [[[1, 2], [1, 2], [1, 2]], [[1, 2, 5], [1, 2, 6], [1, 2, 7]]]
REF_LOGITS = [torch.tensor([[0.0, 1.0], [0.0, 1.0], [0.0, 1.0]]),
              torch.tensor([[10.0, 0.0], [20.0, 0.0], [30.0, 0.0]])]


def test_permuted_beams_are_compared_with_their_own_history() -> None:
    got_ids = [REF_IDS[0], [[1, 2, 6], [1, 2, 5], [1, 2, 7]]]  # beams 0 and 1 swapped rows
    got_logits = [REF_LOGITS[0].clone(), torch.tensor([[20.5, 0.0], [10.0, 0.0], [30.0, 0.0]])]
    steps, first = _compare(_run(REF_IDS, REF_LOGITS), _run(got_ids, got_logits), tee=False)
    assert [s.beams_unmatched for s in steps] == [0, 0]
    assert steps[0].max_abs_logit_diff == 0.0
    assert steps[1].max_abs_logit_diff == 0.5  # [1,2,6]: 20.5 vs 20.0 (row by row it would read 10.5)
    assert first is not None and first.kind == "tokens"  # row by row the chosen tokens still differ: reported


def test_a_beam_the_other_run_lacks_is_counted_not_compared() -> None:
    got_ids = [REF_IDS[0], [[1, 2, 5], [1, 2, 6], [1, 2, 8]]]  # the third beam took another candidate
    got_logits = [REF_LOGITS[0].clone(), torch.tensor([[10.0, 0.25], [20.0, 0.0], [-40.0, 0.0]])]
    steps, _ = _compare(_run(REF_IDS, REF_LOGITS), _run(got_ids, got_logits), tee=False)
    assert steps[1].beams_unmatched == 1
    assert steps[1].max_abs_logit_diff == 0.25  # the unmatched row's 70 is not a logit difference


def test_identical_runs_read_zero_and_outside_beams_nothing_is_matched() -> None:
    same = [x.clone() for x in REF_LOGITS]
    steps, first = _compare(_run(REF_IDS, REF_LOGITS), _run(REF_IDS, same), tee=False)
    assert first is None and all(s.max_abs_logit_diff == 0.0 and s.beams_unmatched == 0 for s in steps)
    # greedy / sampling (no histories recorded): row by row, as before
    got_logits = [REF_LOGITS[0].clone(), torch.tensor([[20.0, 0.0], [10.0, 0.0], [30.0, 0.0]])]
    steps, _ = _compare(_run(REF_IDS, REF_LOGITS, record=False), _run(REF_IDS, got_logits, record=False), tee=False)
    assert steps[1].beams_unmatched is None and steps[1].max_abs_logit_diff == 10.0
