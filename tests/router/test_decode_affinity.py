"""Cache-aware decode routing (`--decode-policy cache_aware`, or `--policy cache_aware` for
both roles): a conversation's next turn goes back to the decode server that holds its
earlier turns' KV, chosen independently of the prefill server, under the same balance
guard as prefill; workers added and removed at run time keep the decode tree in step.
Fake workers behind an in-process router."""

from __future__ import annotations

import threading
from typing import Any
from urllib.parse import quote

import httpx

from pdserve.router.fake_worker import FakeWorker, ThreadedServer
from tests.router.conftest import FakeDeployment, fake_deployment
from tests.waiting import wait_until

SYSTEM = "You are a careful assistant that answers questions about the weather in short sentences. "


def path_of(url: str) -> str:
    return "/workers/" + quote(url, safe="")


class Conversation:
    """A chat whose every turn sends the whole history: turn k+1's prompt is turn k's
    prompt + the answer + the next user message. Its topic opens the system prompt, so
    that distinct conversations share little more than "system:" (a long shared system
    prompt would rightly draw them all to one server until the balance guard stepped in)."""

    def __init__(self, topic: str) -> None:
        self.messages: list[dict[str, str]] = [{"role": "system", "content": topic + " " + SYSTEM}]

    def turn(self, dep: FakeDeployment, question: str, client: httpx.Client | None = None) -> dict[str, Any]:
        self.messages.append({"role": "user", "content": question})
        r = (client or dep.client).post("/v1/chat/completions",
                                        json={"messages": self.messages, "max_tokens": 4})
        assert r.status_code == 200, r.text
        self.messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
        return r.json()


def served_by(workers: list[FakeWorker], question: str) -> list[int]:
    """Indexes of the workers that got a leg whose last user message is `question`."""
    return [i for i, w in enumerate(workers)
            if any(b.get("messages") and b["messages"][-1]["content"] == question for _, b in w.requests)]


def test_a_conversation_returns_to_its_decode_server_and_conversations_spread():
    # Prefill round robin, decode cache_aware: the two are chosen independently.
    with fake_deployment(2, 3, "--decode-policy", "cache_aware") as dep:
        convs = [Conversation(f"Conversation {c} is about city number {c}.") for c in range(3)]
        homes: list[int] = []
        for c, conv in enumerate(convs):  # first turns: new prefixes, one decode server each
            conv.turn(dep, f"c{c} t0: is it raining?")
            (home,) = served_by(dep.decode, f"c{c} t0: is it raining?")
            homes.append(home)
        assert sorted(homes) == [0, 1, 2]  # distinct conversations spread over the decode servers
        for t in range(1, 4):  # later turns, interleaved: each goes back to its own decode server
            for c, conv in enumerate(convs):
                q = f"c{c} t{t}: and tomorrow?"
                conv.turn(dep, q)
                assert served_by(dep.decode, q) == [homes[c]], (c, t)
        assert sorted(len(w.requests) for w in dep.decode) == [4, 4, 4]
        # ... while prefill went on alternating (its own policy, round robin).
        assert sorted(len(w.requests) for w in dep.prefill) == [6, 6]
        proxy = dep.app.state.router.proxy
        assert (proxy.prefill_policy.name, proxy.decode_policy.name) == ("round_robin", "cache_aware")


def test_policy_cache_aware_gives_both_roles_their_own_affinity():
    with fake_deployment(2, 2, "--policy", "cache_aware") as dep:
        a, b = Conversation("About Oslo."), Conversation("About Lima.")
        a.turn(dep, "a0")
        b.turn(dep, "b0")
        pa, pb = served_by(dep.prefill, "a0"), served_by(dep.prefill, "b0")
        da, db = served_by(dep.decode, "a0"), served_by(dep.decode, "b0")
        assert pa != pb and da != db
        for t in range(1, 3):
            a.turn(dep, f"a{t}")
            b.turn(dep, f"b{t}")
            assert (served_by(dep.prefill, f"a{t}"), served_by(dep.decode, f"a{t}")) == (pa, da)
            assert (served_by(dep.prefill, f"b{t}"), served_by(dep.decode, f"b{t}")) == (pb, db)
        router = dep.app.state.router
        assert router.proxy.prefill_policy.tree is not router.proxy.decode_policy.tree
        info = dep.client.get("/get_server_info").json()["router"]
        assert (info["prefill_policy"], info["decode_policy"]) == ("cache_aware", "cache_aware")


def test_generate_text_continuations_stick_to_their_decode_server():
    with fake_deployment(1, 3, "--decode-policy", "cache_aware") as dep:
        text = {c: f"Story {c} begins. " + SYSTEM for c in "xy"}
        homes = {}
        for c in "xy":
            r = dep.client.post("/generate", json={"text": text[c], "sampling_params": {"max_new_tokens": 4}})
            assert r.status_code == 200, r.text
            homes[c] = [i for i, w in enumerate(dep.decode) if any(b.get("text") == text[c] for _, b in w.requests)]
            text[c] += r.json()["text"]
        assert len(homes["x"]) == len(homes["y"]) == 1 and homes["x"] != homes["y"]
        for t in range(3):
            for c in "xy":
                text[c] += f" Next part {t}."
                r = dep.client.post("/generate", json={"text": text[c], "sampling_params": {"max_new_tokens": 4}})
                assert r.status_code == 200, r.text
                sent = text[c]
                text[c] += r.json()["text"]
                assert [i for i, w in enumerate(dep.decode) if any(b.get("text") == sent for _, b in w.requests)] \
                    == homes[c]


def test_imbalance_overrides_decode_affinity():
    # --balance-abs-threshold 1: affinity may not send to a decode server holding more than
    # one request in flight above the least loaded one.
    with fake_deployment(1, 2, "--decode-policy", "cache_aware", "--balance-abs-threshold", "1") as dep:
        conv = Conversation("About Quito.")
        conv.turn(dep, "t0")
        (home,) = served_by(dep.decode, "t0")
        other = 1 - home
        hot = dep.decode[home]
        hot.faults.gate = threading.Event()  # its requests stay in flight until released
        answers: list[httpx.Response] = []
        held: list[threading.Thread] = []

        def held_turn(question: str) -> None:
            with httpx.Client(base_url=dep.url, timeout=30) as c:
                msgs = conv.messages + [{"role": "user", "content": question}]
                answers.append(c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4}))
        try:
            for k, q in enumerate(("branch 1", "branch 2")):  # 0, then 1 above the other: still affinity
                th = threading.Thread(target=held_turn, args=(q,))
                th.start()
                held.append(th)
                wait_until(lambda: len(hot.requests) == 2 + k)
                assert served_by(dep.decode, q) == [home]
            router = dep.app.state.router
            wait_until(lambda: router.registry.get(dep.server_of(hot).url).in_flight == 2)
            # 2 in flight above the idle server: affinity is overridden, the turn goes there.
            r = dep.client.post("/v1/chat/completions",
                                json={"messages": conv.messages + [{"role": "user", "content": "branch 3"}],
                                      "max_tokens": 4})
            assert r.status_code == 200, r.text
            assert served_by(dep.decode, "branch 3") == [other]
        finally:
            hot.faults.gate.set()
            for th in held:
                th.join(30)
        assert [a.status_code for a in answers] == [200, 200]
        # Balanced again: affinity is back. Branch 1 goes on (the servers' records share
        # turn 0 and "user:branch "; the hot one's covers branch 1 too).
        wait_until(lambda: router.registry.get(dep.server_of(hot).url).in_flight == 0)
        conv.messages += [{"role": "user", "content": "branch 1"},
                          {"role": "assistant", "content": answers[0].json()["choices"][0]["message"]["content"]}]
        conv.turn(dep, "t1")
        assert served_by(dep.decode, "t1") == [home]


def test_removing_a_decode_worker_clears_its_tree_and_added_ones_join():
    fast = ("--health-check-interval", "0.2", "--health-check-timeout", "0.5")
    with fake_deployment(1, 2, "--policy", "cache_aware", *fast) as dep:
        router = dep.app.state.router
        tree = router.proxy.decode_policy.tree
        a, b = Conversation("About Accra."), Conversation("About Perth.")
        a.turn(dep, "a0")
        b.turn(dep, "b0")
        (ha,), (hb,) = served_by(dep.decode, "a0"), served_by(dep.decode, "b0")
        assert ha != hb
        url_a = dep.server_of(dep.decode[ha]).url
        key = "".join(f"{m['role']}:{m['content']}\n" for m in a.messages)
        assert url_a in tree.match(key)
        prefill_marks = router.proxy.prefill_policy.tree.match(key)
        size = tree.size

        assert dep.client.delete(path_of(url_a)).status_code == 202
        wait_until(lambda: dep.client.get(path_of(url_a)).status_code == 404)
        assert url_a not in tree.match(key) and url_a not in router.proxy.decode_policy._new_prefixes
        assert tree.size < size  # the nodes only it had marked went too
        assert router.proxy.prefill_policy.tree.match(key) == prefill_marks  # prefill's tree untouched

        a.turn(dep, "a1")  # conversation a moves to the remaining decode server ...
        assert served_by(dep.decode, "a1") == [hb]
        # ... and a decode server added at run time takes the next new conversation and keeps it.
        w = FakeWorker("decode")
        with ThreadedServer(w.app()) as server:
            r = dep.client.post("/workers", json={"url": server.url, "role": "decode"})
            assert r.status_code == 201, r.text
            c = Conversation("About Riga.")
            c.turn(dep, "c0")
            assert served_by([w], "c0") == [0]
            c.turn(dep, "c1")
            a.turn(dep, "a2")
            b.turn(dep, "b1")
            assert served_by([w], "c1") == [0] and served_by(dep.decode, "a2") == served_by(dep.decode, "b1") == [hb]
            # The old URL back (as a fresh server would be) inherits no affinity: a stays.
            assert dep.client.post("/workers", json={"url": url_a, "role": "decode"}).status_code == 201
            assert url_a not in tree.match(key)
            a.turn(dep, "a3")
            assert served_by(dep.decode, "a3") == [hb]
            assert dep.client.delete(path_of(server.url)).status_code == 202
            wait_until(lambda: dep.client.get(path_of(server.url)).status_code == 404)
            assert server.url not in tree.match("".join(f"{m['role']}:{m['content']}\n" for m in c.messages))
