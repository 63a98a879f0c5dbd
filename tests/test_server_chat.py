"""``POST /v1/chat/completions`` on the simulator's OpenAI-compatible server (``zerosim simulator serve``
without vLLM), driven by the official ``openai`` client and checked on the wire: messages rendered with the
model's chat template, the completions endpoint's checks, vLLM's answer shape and OpenAI's error shape.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from simulators import TransformersBackend
from simulators.openai_server import create_openai_app
from zerosim.core.http.server import running_app
from zerosim.core.models import encode_chat_prompt, format_chat_prompt

LIMIT = 16  # the server's max_tokens limit: also the default of a chat request that sets none


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir):
    from zerosim.core.models import load_causal_lm

    return load_causal_lm(str(tiny_model_dir), "float32")


@pytest.fixture(scope="module")
def chat_url(tiny_lm, tokenizer):
    backend = TransformersBackend(tiny_lm, tokenizer, apply_chat_template=False)
    with running_app(create_openai_app(backend, model_name="tiny", max_tokens_limit=LIMIT)) as url:
        yield url


@pytest.fixture
def client(chat_url):
    with openai.OpenAI(base_url=f"{chat_url}/v1", api_key="unused", max_retries=0, timeout=30) as client:
        yield client


def test_the_official_client_chats_and_gets_the_in_process_text(client, tiny_lm, tokenizer):
    """The client's default call: the answer is what the in-process simulator backend (chat template
    applied, same seed) writes for the same user message."""
    answer = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Write a document about Lima."}],
        max_tokens=6,
        temperature=0.7,
        seed=3,
    )
    (choice,) = answer.choices
    assert answer.object == "chat.completion" and answer.model == "tiny" and answer.id.startswith("chatcmpl-")
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    local = TransformersBackend(tiny_lm, tokenizer).complete(
        ["Write a document about Lima."], max_new_tokens=6, temperature=0.7, top_p=1.0, seed=3
    )
    assert choice.message.content == local[0]
    usage = answer.usage
    assert usage.prompt_tokens == len(encode_chat_prompt(tokenizer, "Write a document about Lima."))
    assert 1 <= usage.completion_tokens <= 6
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_the_official_client_without_max_tokens_gets_at_most_the_server_limit(client):
    answer = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        temperature=0,
    )
    assert 1 <= answer.usage.completion_tokens <= LIMIT


def test_the_official_client_completes_a_batch_too(client):
    answer = client.completions.create(model="tiny", prompt=["one", "two", "three"], max_tokens=3, seed=1)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert all(isinstance(c.text, str) for c in answer.choices)


@pytest.mark.parametrize(
    ("settings", "error", "param", "words"),
    [
        pytest.param({"model": "gpt-9"}, openai.NotFoundError, "model", "gpt-9", id="unknown-model"),
        pytest.param({"temperature": -1}, openai.BadRequestError, "temperature", ">= 0", id="temperature"),
        pytest.param({"top_p": 0}, openai.BadRequestError, "top_p", "greater than 0", id="top_p"),
        pytest.param({"max_tokens": 0}, openai.BadRequestError, "max_tokens", ">= 1", id="max_tokens-0"),
        pytest.param({"max_tokens": LIMIT + 1}, openai.BadRequestError, "max_tokens", "exceeds", id="limit"),
        pytest.param({"n": 2}, openai.BadRequestError, "n", "not supported", id="n-2"),
        pytest.param({"logprobs": True}, openai.BadRequestError, "logprobs", "not supported", id="logprobs"),
        pytest.param({"messages": []}, openai.BadRequestError, "messages", "at least 1", id="no-messages"),
    ],
)
def test_the_official_client_raises_the_servers_errors(client, settings, error, param, words):
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **settings}
    with pytest.raises(error) as raised:
        client.chat.completions.create(**request)
    body = raised.value.body  # the "error" object of OpenAI's shape
    assert body["param"] == param and words.replace(">= ", "") in body["message"], body


# -- on the wire ------------------------------------------------------------------------------------------


DROP = object()  # a field left out of the request


def _chat(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", **body}, timeout=30)


def test_wire_format_is_vllms(chat_url):
    response = _chat(chat_url, messages=[{"role": "user", "content": "hi"}], max_tokens=3, seed=1)
    assert response.status_code == 200, response.text
    data = response.json()
    assert set(data) == {"id", "object", "created", "model", "choices", "usage"}
    assert data["object"] == "chat.completion" and data["model"] == "tiny"
    assert data["id"].startswith("chatcmpl-") and isinstance(data["created"], int)
    (choice,) = data["choices"]
    assert set(choice) == {"index", "message", "logprobs", "finish_reason"}
    assert choice["index"] == 0 and choice["logprobs"] is None
    assert set(choice["message"]) == {"role", "content"} and choice["message"]["role"] == "assistant"
    assert set(data["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}


def test_messages_are_rendered_with_the_chat_template(chat_url, tokenizer):
    """A chat request is the completion of its messages rendered by the template (generation prompt added);
    text parts are joined by newlines; max_completion_tokens wins over max_tokens."""
    messages = [
        {"role": "system", "content": "You write search results."},
        {"role": "user", "content": "capital of Peru"},
        {"role": "assistant", "content": "Lima."},
        {"role": "user", "content": "and of Chile?\nOne line."},
    ]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\n")
    sampling = {"temperature": 0.9, "seed": 5}
    chat = _chat(chat_url, messages=messages, max_tokens=5, **sampling).json()
    completion = httpx.post(
        f"{chat_url}/v1/completions",
        json={"model": "tiny", "prompt": rendered, "max_tokens": 5, **sampling},
        timeout=30,
    ).json()
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]
    assert chat["usage"] == completion["usage"]

    parts = [*messages[:3], {"role": "user", "content": [
        {"type": "text", "text": "and of Chile?"}, {"type": "text", "text": "One line."}
    ]}]  # fmt: skip
    with_parts = _chat(chat_url, messages=parts, max_tokens=9, max_completion_tokens=5, **sampling).json()
    assert with_parts["choices"] == chat["choices"] and with_parts["usage"] == chat["usage"]

    one_user_turn = _chat(chat_url, messages=[messages[1]], max_tokens=2).json()
    assert one_user_turn["usage"]["prompt_tokens"] == len(
        tokenizer(format_chat_prompt(tokenizer, "capital of Peru"))["input_ids"]
    )


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        pytest.param({"messages": DROP}, "messages", "required", id="no-messages"),
        pytest.param({"messages": "hi"}, "messages", "list", id="messages-string"),
        pytest.param({"messages": [{"content": "hi"}]}, "messages.0.role", "required", id="no-role"),
        pytest.param(
            {"messages": [{"role": "user", "content": 3}]}, "messages.0.content", "", id="content-int"
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages.0.content",
            "text",
            id="image-part",
        ),
        pytest.param({"stream": True}, "stream", "not supported", id="stream"),
        pytest.param({"temperature": "hot"}, "temperature", "number", id="temperature-string"),
        pytest.param({"max_completion_tokens": 0}, "max_completion_tokens", ">= 1", id="max_completion-0"),
        pytest.param(
            {"max_completion_tokens": LIMIT + 1},
            "max_completion_tokens",
            "exceeds",
            id="max_completion-limit",
        ),
    ],
)
def test_wire_errors_are_400_in_openais_shape(chat_url, body, param, words):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}
    response = _chat(chat_url, **{k: v for k, v in body.items() if v is not DROP})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400
    assert error["param"] == param and words.replace(">= ", "") in error["message"], error


def test_a_model_without_a_chat_template_or_refusing_the_messages_is_a_400(tiny_lm, tiny_model_dir):
    from zerosim.core.models import load_tokenizer

    plain = load_tokenizer(str(tiny_model_dir))
    plain.chat_template = None
    strict = load_tokenizer(str(tiny_model_dir))
    strict.chat_template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    for tokenizer, words in ((plain, "has no chat template"), (strict, "roles must alternate")):
        backend = TransformersBackend(tiny_lm, tokenizer, apply_chat_template=False)
        with running_app(create_openai_app(backend, model_name="tiny")) as url:
            response = _chat(url, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            assert response.status_code == 400 and words in response.json()["error"]["message"]
            # the completions endpoint does not need a template
            completion = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
            assert httpx.post(f"{url}/v1/completions", json=completion, timeout=30).status_code == 200


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stop_ends_the_text_before_the_first_stop_string_as_vllm_does(client, endpoint):
    """``stop`` (a string or a list) is honoured: the text ends before the first stop string found, which is
    left out, and the choice finishes with "stop" (it was dropped unread before)."""

    def ask(**extra):
        if endpoint == "completions":
            answer = client.completions.create(
                model="tiny", prompt="Lima is", max_tokens=LIMIT, temperature=0, **extra
            )
            return answer.choices[0].text, answer.choices[0].finish_reason
        answer = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Lima is"}], max_tokens=LIMIT, temperature=0, **extra
        )  # fmt: skip
        return answer.choices[0].message.content or "", answer.choices[0].finish_reason

    full, _ = ask()
    assert len(full) >= 4, full
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    cut, finish = ask(stop=["\u2603never\u2603", stop])
    assert cut == full[: full.find(stop)] and finish == "stop"
    assert ask(stop=stop)[0] == cut
    with pytest.raises(openai.BadRequestError, match="empty string"):
        ask(stop=[""])
