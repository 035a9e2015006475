"""A vision-language model through the official `openai` SDK against `tessera serve
--catalog` (started by tests/tests/vision_openai.rs): the tiny SmolVLM of the worker's
fixtures, served from its Hugging Face directory under two catalog ids (the second with
a short context, for frame sampling). Images go inline as data URIs."""

import base64
import os
import struct
import unittest
import zlib

import openai

MODEL = "tiny/smolvlm"
SHORT = "tiny/smolvlm-short"
IMAGES = os.environ["TESSERA_VISION_IMAGES"]


def client():
    return openai.OpenAI(base_url=os.environ["TESSERA_BASE_URL"], api_key=os.environ["TESSERA_API_KEY"],
                         max_retries=0, _strict_response_validation=True)


def image(name, detail=None):
    with open(os.path.join(IMAGES, name), "rb") as f:
        url = "data:image/png;base64," + base64.b64encode(f.read()).decode()
    part = {"type": "image_url", "image_url": {"url": url}}
    if detail:
        part["image_url"]["detail"] = detail
    return part


def big_png(width, height):
    """An uncompressed PNG of noise: its bytes are its pixels, over 4 MiB here."""
    rows = b"".join(b"\0" + os.urandom(width * 3) for _ in range(height))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    data = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 0)) + chunk(b"IEND", b"")
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def ask(*parts, model=MODEL, **kw):
    content = [{"type": "text", "text": "Describe this."}, *parts]
    return client().chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                            max_tokens=kw.pop("max_tokens", 4), temperature=0, **kw)


class Vision(unittest.TestCase):
    def test_image_tokens_are_counted_by_size_and_detail(self):
        text = client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe this."}],
                                                max_tokens=4, temperature=0)
        high, low = ask(image("wide.png", "high")), ask(image("wide.png", "low"))
        self.assertTrue(high.choices[0].message.content is not None)
        # 50 x 30 at this model's geometry: 6 tiles and a global one of 4 tokens each, with
        # their markers; `low` is the global tile alone.
        self.assertGreaterEqual(high.usage.prompt_tokens - text.usage.prompt_tokens, 7 * 4)
        self.assertGreaterEqual(high.usage.prompt_tokens - low.usage.prompt_tokens, 6 * 4)
        self.assertGreater(low.usage.prompt_tokens, text.usage.prompt_tokens + 4)

    def test_the_same_image_is_served_from_the_prefix_cache_and_another_is_not(self):
        first = ask(image("square_rgba.png"), {"type": "text", "text": " And again."})
        again = ask(image("square_rgba.png"), {"type": "text", "text": " And again."})
        self.assertEqual(again.choices[0].message.content, first.choices[0].message.content)
        cached = again.usage.prompt_tokens_details.cached_tokens
        self.assertGreater(cached, 40, "the image's blocks were cached")
        # tall.png is another size: fewer blocks of its prompt can match, and none past its image.
        other = ask(image("frame0.png"), {"type": "text", "text": " And again."})
        self.assertLess(other.usage.prompt_tokens_details.cached_tokens, cached)

    def test_a_video_is_sampled_down_to_fit_the_context(self):
        frames = [image(f"frame{i}.png") for i in range(4)]
        raw = client().chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "What happens?"}, *frames]}],
            max_tokens=4, temperature=0)
        self.assertEqual(raw.headers.get("x-video-frames"), "4/4")
        whole = raw.parse().usage.prompt_tokens
        raw = client().chat.completions.with_raw_response.create(
            model=SHORT, messages=[{"role": "user", "content": [{"type": "text", "text": "What happens?"}, *frames]}],
            max_tokens=4, temperature=0)
        kept, sent = map(int, raw.headers.get("x-video-frames").split("/"))
        self.assertEqual(sent, 4)
        # Four frames take 209 tokens, three 185, two 158: two fit 170 with room for 4.
        self.assertEqual(kept, 2, raw.headers.get("x-video-frames"))
        r = raw.parse()
        self.assertLess(r.usage.prompt_tokens, whole)
        self.assertLessEqual(r.usage.prompt_tokens + 4, 170)

    def test_the_responses_endpoint_takes_input_images(self):
        png = image("wide.png")["image_url"]["url"]
        content = [{"type": "input_text", "text": "Describe this."}, {"type": "input_image", "image_url": png}]
        r = client().responses.create(model=MODEL, max_output_tokens=4, input=[{"role": "user", "content": content}])
        self.assertGreater(r.usage.input_tokens, 7 * 4)
        # Instructions reach the template as text too (a vision template reads parts).
        told = client().responses.create(model=MODEL, max_output_tokens=4, instructions="Answer in French, briefly.",
                                         input=[{"role": "user", "content": content}])
        # Their text, not only an empty system turn (10 tokens here; 36 with the text).
        self.assertGreater(told.usage.input_tokens, r.usage.input_tokens + 20)

    def test_the_image_token_typed_as_text_is_the_clients_mistake(self):
        with self.assertRaises(openai.BadRequestError) as e:
            ask({"type": "text", "text": "look: <image>"}, image("wide.png"))
        self.assertEqual(e.exception.body["param"], "messages")
        self.assertIn("<image>", e.exception.body["message"])

    def test_an_image_larger_than_a_default_grpc_message_reaches_the_worker(self):
        part = big_png(1300, 1100)
        self.assertGreater(len(part["image_url"]["url"]) * 3 // 4, 4 << 20)
        r = ask(part)
        self.assertGreater(r.usage.prompt_tokens, 7 * 4)

    def test_a_bad_image_is_named_on_a_vision_model_too(self):
        junk = {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8gd29ybGQ="}}
        with self.assertRaises(openai.BadRequestError) as e:
            ask(image("wide.png"), junk)
        self.assertEqual(e.exception.body["param"], "messages[0].content[2].image_url")
        self.assertIn("not an image", e.exception.body["message"])


if __name__ == "__main__":
    unittest.main(verbosity=2)
