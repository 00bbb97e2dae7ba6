"""The vLLM encoder's renders handed to vLLM's renderer threads together (`_RenderTogether`,
worker/adapters/vllm_pooling.py): the prompts a handler asks for in one loop turn go to the
executor as one job per thread, each answered, or failed, on its own future, in the order asked."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from worker.adapters.vllm_pooling import _RenderTogether


class _Renders:
    """A render that notes the prompts it rendered, and refuses the prompt "bad"."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, prompt: str) -> str:
        self.calls.append(prompt)
        if prompt == "bad":
            raise ValueError(f"refused: {prompt}")
        return prompt.upper()


async def _render(threads: int, prompts: list[str]) -> tuple[list, _Renders, int]:
    renders = _Renders()
    submitted = []
    with ThreadPoolExecutor(threads) as executor:
        original = executor.submit

        def counting_submit(fn, /, *args, **kwargs):
            submitted.append(fn)
            return original(fn, *args, **kwargs)

        executor.submit = counting_submit
        together = _RenderTogether(renders, executor, threads)
        answers = await asyncio.gather(*(together(prompt) for prompt in prompts), return_exceptions=True)
        # a later turn's prompts make a job of their own
        answers.append(await together("later"))
    return answers, renders, len(submitted)


def test_one_turns_prompts_go_to_one_job_in_order_each_with_its_own_answer_or_error():
    answers, renders, jobs = asyncio.run(_render(1, ["a", "b", "bad", "c"]))
    assert answers[:2] == ["A", "B"] and answers[3:] == ["C", "LATER"]
    assert isinstance(answers[2], ValueError) and str(answers[2]) == "refused: bad"
    assert renders.calls == ["a", "b", "bad", "c", "later"]
    assert jobs == 2  # one for the turn's four prompts, one for the later prompt


def test_with_several_renderer_threads_the_turns_prompts_are_split_between_them():
    prompts = [f"p{i}" for i in range(7)]
    answers, renders, jobs = asyncio.run(_render(3, prompts))
    assert answers == [p.upper() for p in prompts] + ["LATER"]
    assert jobs == 3 + 1
    assert sorted(renders.calls) == sorted([*prompts, "later"])


def test_a_prompt_its_handler_stopped_waiting_for_is_left_alone():
    async def scenario() -> list:
        renders = _Renders()
        with ThreadPoolExecutor(1) as executor:
            together = _RenderTogether(renders, executor, 1)
            kept, dropped = together("kept"), together("dropped")
            dropped.cancel()
            return [await kept, dropped.cancelled(), renders.calls]

    assert asyncio.run(scenario()) == ["KEPT", True, ["kept", "dropped"]]


def test_an_executor_shut_down_fails_each_prompt_instead_of_leaving_it_waiting():
    async def scenario() -> list:
        executor = ThreadPoolExecutor(1)
        executor.shutdown()
        together = _RenderTogether(_Renders(), executor, 1)
        return await asyncio.wait_for(asyncio.gather(together("a"), together("b"), return_exceptions=True), 5)

    answers = asyncio.run(scenario())
    assert [type(answer) for answer in answers] == [RuntimeError, RuntimeError]


@pytest.mark.parametrize("threads", [1, 2])
def test_no_prompts_no_job(threads):
    answers, _, jobs = asyncio.run(_render(threads, []))
    assert answers == ["LATER"] and jobs == 1
