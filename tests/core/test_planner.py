"""The step planner, tick by tick, with no thread and no runtime (as mlx-lm tests its
BatchGenerator): who feeds what in each step, and that nothing starves."""

from __future__ import annotations

from butter.engine.events import SyncChannel
from butter.engine.planner import Planner
from butter.engine.records import Phase, Request, Session
from butter.generation import GenerationParams

SAMPLER = object()


def request(prompt_length: int, *, decoding: bool = False, seq: int = 0) -> Request:
    record = Request(list(range(prompt_length)), GenerationParams(), SyncChannel())
    record.prompt_tokens = list(record.prompt)
    record.session = Session(seq_id=seq)
    record.sampler = SAMPLER
    if decoding:
        record.phase, record.next_prefill, record.last_token = Phase.DECODE, prompt_length, 1
    else:
        record.phase = Phase.PREFILL
    return record


def run(planner: Planner, active: list[Request]) -> dict[int, int]:
    """One tick, applied as the engine applies a finished step: tokens fed per request."""
    fed = {}
    for planned in planner.tick(active):
        record, work = planned.request, planned.work
        fed[record.id] = len(work.tokens)
        if record.phase is Phase.PREFILL:
            record.next_prefill += len(work.tokens)
            if work.sampler is not None:
                assert record.next_prefill == len(record.prompt_tokens)
                record.phase, record.last_token = Phase.DECODE, 1
    return fed


def test_prefill_advances_when_decoding_rows_fill_the_step():
    # MLX steps hold 32 rows: 32 decoding sessions used to starve every new prompt.
    planner = Planner(max_batch=32, prefill_chunk=256)
    decoding = [request(10, decoding=True, seq=i) for i in range(32)]
    newcomer = request(100, seq=40)
    active = [*decoding, newcomer]
    steps = 0
    while newcomer.phase is Phase.PREFILL:
        left = len(newcomer.prompt_tokens) - newcomer.next_prefill
        fed = run(planner, active)
        assert sum(fed.values()) <= 32
        assert fed.get(newcomer.id, 0) == min(16, left)  # a chunk cut to half the step
        steps += 1
    assert steps == 7  # 100 tokens, 16 a step
    # The decoding rows that waited go first next time: none waits twice in a row.
    planner = Planner(max_batch=32, prefill_chunk=256)
    waited_before: set[int] = set()
    for _ in range(6):
        fed = run(planner, [*decoding, request(100, seq=41)])
        waited = {r.id for r in decoding if r.id not in fed}
        assert len(waited) == 16 and not waited & waited_before
        waited_before = waited


def test_the_shortest_prompt_goes_first_and_an_ending_step_takes_no_longer_chunk():
    planner = Planner(max_batch=512, prefill_chunk=256)
    long, short = request(2000, seq=0), request(30, seq=1)
    fed = run(planner, [long, short])
    assert fed == {short.id: 30}  # it ends its prompt: the long chunk waits
    fed = run(planner, [long, short])
    assert fed == {short.id: 1, long.id: 256}  # the waiting chunk goes now


def test_chunks_end_at_multiples_of_the_chunk_size_whatever_runs_beside():
    planner = Planner(max_batch=512, prefill_chunk=64)
    alone = request(300, seq=0)
    cuts_alone = []
    while alone.phase is Phase.PREFILL:
        before = alone.next_prefill
        run(planner, [alone])
        cuts_alone.append(alone.next_prefill - before)
    planner = Planner(max_batch=512, prefill_chunk=64)
    batched, other = request(300, seq=0), request(300, seq=1)
    other.next_prefill = 10
    cuts = []
    while batched.phase is Phase.PREFILL:
        before = batched.next_prefill
        run(planner, [other, batched])
        cuts.append(batched.next_prefill - before)
    assert [c for c in cuts if c] == cuts_alone == [64, 64, 64, 64, 44]


def test_a_small_step_takes_what_fits():
    planner = Planner(max_batch=8, prefill_chunk=256)
    record = request(20)
    assert run(planner, [record]) == {record.id: 8}
    assert run(planner, [record]) == {record.id: 8}
    assert run(planner, [record]) == {record.id: 4} and record.phase is Phase.DECODE


def test_prompts_that_arrive_together_end_one_after_another():
    # As in llama-server and vLLM: the first ones get their first token early, instead of
    # every prompt advancing a chunk a round and all of them ending near the end.
    planner = Planner(max_batch=512, prefill_chunk=256)
    lanes = [request(1100, seq=i) for i in range(8)]
    ended_at = {}
    step = 0
    while len(ended_at) < len(lanes):
        step += 1
        run(planner, lanes)
        ended_at.update({r.id: step for r in lanes
                         if r.phase is Phase.DECODE and r.id not in ended_at})
    order = sorted(lanes, key=lambda r: ended_at[r.id])
    assert order == lanes  # ties go to the earlier request
    last = ended_at[lanes[7].id]
    assert ended_at[lanes[0].id] * 5 <= last and ended_at[lanes[3].id] * 2 <= last


def test_a_long_prompt_behind_shorter_ones_goes_first_once_its_patience_ends():
    planner = Planner(max_batch=512, prefill_chunk=256, patience=3)
    long = request(2000, seq=0)
    shorter = [request(1000, seq=1), request(1000, seq=2)]
    fed = [run(planner, [long, *shorter]).get(long.id, 0) for _ in range(4)]
    assert fed == [0, 0, 0, 256]  # three waits, then first
