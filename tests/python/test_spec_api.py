"""Speculative decoding seen through the official `openai` SDK: the same requests to a
`tessera serve` speculating (TESSERA_BASE_URL) and one not (TESSERA_OFF_BASE_URL) get the
same answers — text, finish, log-probabilities — and the same usage, which is what is
billed: rejected proposals are never output tokens. Started by tests/tests/qwen_openai.rs."""

import os
import unittest

import openai

MODEL = "qwen/qwen2.5-coder-0.5b-instruct"
CODE = """def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def variance(values):
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / len(values)
"""
EDIT = [{"role": "user", "content": "Add a docstring to each function; reply with the full code only.\n\n```python\n"
                                    + CODE + "```"}]


def clients():
    def make(base, key):
        return openai.OpenAI(base_url=os.environ[base], api_key=os.environ[key], max_retries=0,
                             _strict_response_validation=True)
    return make("TESSERA_BASE_URL", "TESSERA_API_KEY"), make("TESSERA_OFF_BASE_URL", "TESSERA_OFF_API_KEY")


def answers(response):
    return [(c.index, c.message.content, c.finish_reason, c.logprobs.model_dump() if c.logprobs else None)
            for c in sorted(response.choices, key=lambda c: c.index)]


class SameWithAndWithoutSpeculation(unittest.TestCase):
    def both(self, **kwargs):
        on, off = clients()
        a = on.chat.completions.create(model=MODEL, **kwargs)
        b = off.chat.completions.create(model=MODEL, **kwargs)
        self.assertEqual(answers(a), answers(b))
        self.assertEqual(a.usage.model_dump(), b.usage.model_dump(), "the same usage, so the same bill")
        return a

    def test_a_code_edit(self):
        a = self.both(messages=EDIT, temperature=0, max_tokens=160)
        self.assertIn("def variance(values):", a.choices[0].message.content)
        self.assertGreater(a.usage.completion_tokens, 60)

    def test_log_probabilities_and_stops(self):
        self.both(messages=EDIT, temperature=0, max_tokens=64, logprobs=True, top_logprobs=3)
        self.both(messages=EDIT, temperature=0, max_tokens=120, stop=["len(values)"])

    def test_seeded_samples(self):
        self.both(messages=EDIT, temperature=0.7, top_p=0.9, seed=5, n=2, max_tokens=64)

    def test_a_stream_and_its_usage(self):
        def stream(client):
            chunks = list(client.chat.completions.create(model=MODEL, messages=EDIT, temperature=0, max_tokens=96,
                                                         stream=True, stream_options={"include_usage": True}))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return text, chunks[-1].usage.model_dump()
        on, off = clients()
        self.assertEqual(stream(on), stream(off))


if __name__ == "__main__":
    unittest.main(verbosity=2)
