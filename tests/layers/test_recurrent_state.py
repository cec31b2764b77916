"""The recurrent state cache's own parts: the shared checkpoint buffer and its allocation."""
import torch

from runtime.layers.recurrent_state import CheckpointBuffer, RecurrentStateCache, StatefulLayer


class TwoStates(StatefulLayer):
    def state_shapes(self):
        return [((3, 2), torch.bfloat16), ((2, 4, 4), torch.float32)]


def test_the_checkpoint_buffer_is_one_storage_reused_and_grown():
    buffer = CheckpointBuffer()
    first = buffer.take((2, 4, 4), torch.device("cpu"))
    again = buffer.take((1, 4, 4), torch.device("cpu"))
    assert first.shape == (2, 4, 4) and again.shape == (1, 4, 4)
    assert again.data_ptr() == first.data_ptr()  # no new allocation for a smaller step
    bigger = buffer.take((5, 4, 4), torch.device("cpu"))
    assert bigger.shape == (5, 4, 4) and bigger.dtype == torch.float32
    assert buffer.take((5, 4, 4), torch.device("cpu")).data_ptr() == bigger.data_ptr()


def test_every_layer_shares_the_models_buffer_and_gets_zeroed_states():
    model = torch.nn.Sequential(TwoStates(), TwoStates())
    cache = RecurrentStateCache(model)
    cache.allocate(num_slots=3, device=torch.device("cpu"), num_checkpoints=2)
    a, b = model
    assert a.checkpoint_buffer is b.checkpoint_buffer is cache.buffer
    for layer in (a, b):
        assert [s.shape for s in layer.states] == [(3, 3, 2), (3, 2, 4, 4)]
        assert [c.shape for c in layer.checkpoints] == [(2, 3, 2), (2, 2, 4, 4)]
        assert all(t.eq(0).all() for t in layer.states + layer.checkpoints)
    rows = torch.tensor([4, 9])
    kept = a.checkpoint_states(rows)
    assert kept.shape == (2, 2, 4, 4) and a.checkpoint_states(None) is None
    assert b.checkpoint_states(rows).data_ptr() == kept.data_ptr()
    cache.release()
    assert cache.buffer.flat.numel() == 0
