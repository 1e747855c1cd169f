"""The scheduler's adapter slots (max_loras): a request whose adapter must wait for a slot does
not hold up the requests behind it that may run (the base model's, or a running adapter's)."""

from __future__ import annotations

import pytest

from asyncengine.config import SchedulerConfig
from asyncengine.ipc.messages import EngineCoreRequest
from asyncengine.sampling_params import SamplingParams
from asyncengine.sched.kv_cache_manager import KVCacheManager
from asyncengine.sched.lora_slots import LoRASlots
from asyncengine.sched.scheduler import Scheduler

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "sjf"])
def test_a_waiting_adapter_does_not_hold_up_the_requests_behind_it(policy: str) -> None:
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, policy=policy
    )
    sched = Scheduler(config, KVCacheManager(64, 4, False), eos_token_ids=(0,))
    sched.lora_slots = LoRASlots(max_loras=1)
    for name in ("a", "b"):
        sched.lora_slots.register(name, f"/adapters/{name}")
    params = SamplingParams(max_tokens=4)
    for i, lora in enumerate(["a", "b", None, "a"]):
        prompt = [1 + i, 2, 3]
        sched.add_request(EngineCoreRequest(f"r{i}", prompt, params, float(i), lora_name=lora))
    out = sched.schedule()
    # "a" takes the one slot; r1 (adapter b) waits, the base request and a's second run.
    assert set(out.num_scheduled_tokens) == {"r0", "r2", "r3"}
    assert [r.request_id for r in sched.waiting] == ["r1"]
