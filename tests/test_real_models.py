"""Real embedded pair (make setup converts it). Marked slow: `make test-slow`."""
from __future__ import annotations

import pytest
import torch

from specdec import embedded
from specdec.models import load_model
from tests.stack import _MODEL_CACHE, start_stack

TARGET, DRAFT = embedded.DEFAULT_TARGET, embedded.DEFAULT_DRAFT
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def models_present() -> None:
    for ref in (TARGET, DRAFT):
        name = ref.split(":", 1)[1]
        assert embedded.is_ready(name), f"{ref} is not converted: run `make setup` first"


async def test_real_pair_greedy_identical_to_target_alone() -> None:
    _MODEL_CACHE[DRAFT, torch.bfloat16] = load_model(DRAFT, torch.bfloat16)
    stack = await start_stack(target_ref=TARGET, draft_ref=DRAFT, draft_dtype=torch.bfloat16)
    try:
        tok = _MODEL_CACHE[TARGET, torch.float32].tokenizer
        prompt = tok.apply_chat_template([{"role": "user", "content": "Write a Python function to reverse a list."}])
        reply = await stack.generate(prompt_ids=prompt, max_new_tokens=24, speculation={"policy": "cost"},
                                     timeout=600)
        model = _MODEL_CACHE[TARGET, torch.float32].model
        want = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
        assert list(reply.token_ids) == want
        assert reply.stats.acceptance_rate > 0.5
    finally:
        await stack.close()


def test_the_embedded_models_stop_at_the_end_of_a_document_too() -> None:
    """<|endoftext|> (151643) as well as <|im_end|> (151645), as the published Qwen2.5 generation
    config has them; the GGUF named only the latter. The loaded model's generation config agrees, so
    HF generate (the bench's reference) stops where the service does."""
    from specdec.models import load_model
    from specdec.tokenizers import load_tokenizer
    assert {151643, 151645} <= set(load_tokenizer(TARGET).eos_token_ids)
    loaded = load_model(DRAFT)
    assert {151643, 151645} <= set(loaded.eos_token_ids) <= set(loaded.model.generation_config.eos_token_id)


def test_incremental_text_equals_decoding_the_whole_output_on_the_real_tokenizer() -> None:
    """Byte-level BPE: CJK, emoji and accents split across tokens, streamed a round at a time."""
    from orchestrator.text import TextAssembler
    from specdec.tokenizers import load_tokenizer
    tok = load_tokenizer(TARGET)
    text = "def f(x):\n    return x  # 日本語のコメント 😀👍🏽 naïve café — ✓\n" * 20
    ids = tok.encode(text)
    for stop in ([], ["😀👍"], ["ret", "\n\n\n"]):
        asm = TextAssembler(tok.decode, stop)
        out, kept = [], 0
        for i in range(0, len(ids), 3):
            delta, keep = asm.add(ids[i:i + 3])
            out.append(delta)
            kept += keep
            if asm.stopped:
                break
        out.append(asm.flush())
        whole = tok.decode(ids[:kept])
        cut = min((h for h in (whole.find(s) for s in stop) if h >= 0), default=len(whole))
        assert "".join(out) == whole[:cut]
        assert asm.stopped == bool(stop) and (cut < len(whole)) == bool(stop)
        assert not any(s in tok.decode(ids[:kept - 1]) for s in stop)  # kept ends at the completing token
