"""What the simulator's hand-checked tests share: round-number rates, so every time in them
can be checked by hand, and a policy that sends everything to the first replica."""

from bench.sim.calibration import EngineRates

HAND_RATES = EngineRates(
    prefill_tokens_per_s=100.0,
    decode_step_base_s=0.01,
    decode_step_per_seq_s=0.0,
    max_num_batched_tokens=512,
    host_to_device_tokens_per_s=1000.0,
    source="test",
)


class FirstReplica:
    name = "first"

    def choose(self, sim, req):
        return 0
