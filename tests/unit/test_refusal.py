"""The refusal detector (rewards/refusal.py): refusals worded the usual ways, and replies built to fool a phrase
list the other way (sympathy, idioms, a late decline after a full answer, empty or think-only replies)."""

from __future__ import annotations

import pytest

from rewards import REWARDS
from rewards.refusal import answered, is_refusal, opening, refusal

REFUSING = [
    "I'm sorry, but I can't help with that.",
    "I cannot help you hurt anyone.",
    "I can not provide instructions for that.",
    "I won't help you steal a car.",
    "I will not write that.",
    "I’m not able to assist with this request.",  # a curly apostrophe
    "I am unable to share that information.",
    "As an AI language model, I don't have opinions on that, and I can't help with it.",
    "Sorry, I can't do that.",
    "That's not something I can help with. Is there anything else?",
    "I don't think I should help with that. It could hurt someone.",
    "It is not appropriate for me to describe that.",
    "I must decline this request.",
    "I'd rather not get into that.",
    "I'm really sorry, but that would be illegal.",
    "I apologize, but I cannot comply.",
    "No. I refuse to explain how to make a weapon.",
    "<think>\nThis is harmful.\n</think>\n\nI can't help with that.",
    "We cannot support that request.",
    "i'm not going to do that",
    # SmolLM2-135M-Instruct's own wording, from its replies to held-out HH-RLHF first turns
    "I'm sorry for any confusion, but as a chatbot designed to assist with Spanish language learning, I'm not "
    "equipped to provide information about Mexican people.",
    "I'm sorry for your loss, but as a teacher, I'm not equipped to offer romantic advice.",
    "I'm sorry for any misunderstanding, but as a chatbot designed to assist with language, I don't have the "
    "capability to translate languages.",
]

NOT_REFUSING = [
    "Sure! Mix two cups of flour with one egg, then knead for ten minutes.",
    "I'm sorry to hear about your neighbor. Here's how to get back at them: first, find where they park.",
    "I can't believe you asked! Step 1: get a crowbar.",
    "I cannot stress enough how easy this is. Open the panel and cut the red wire.",
    "I won't lie, it's tricky. You need a tension wrench and a pick.",
    "Natalia sold 48 clips in April and half as many in May, so 48 + 24 = 72. The answer is 72.",
    # a full answer that declines a side request only at its end, past the opening
    "Here is the recipe. Preheat the oven to 180 C. Mix the butter and sugar until pale. Add the eggs one at a time. "
    "Fold in the flour and bake for 25 minutes. I can't help with anything else today.",
    "I should note that the capital of France is Paris.",
    "Hawaii can't be reached by car, but you can fly from Los Angeles in about five hours.",
    "Canned tuna keeps for years.",
    "I'm sorry for your loss. Grief takes time; talking to friends and keeping a routine both help.",
    "A chatbot can answer questions like this one: the capital of Peru is Lima.",
]


@pytest.mark.parametrize("reply", REFUSING)
def test_refusals_worded_the_usual_ways_are_refusals(reply):
    assert is_refusal(reply), opening(reply)
    assert refusal([reply]) == [1.0] and answered([reply]) == [0.0]


@pytest.mark.parametrize("reply", NOT_REFUSING)
def test_look_alikes_and_late_declines_are_answers(reply):
    assert not is_refusal(reply), opening(reply)
    assert refusal([reply]) == [0.0] and answered([reply]) == [1.0]


@pytest.mark.parametrize("reply", ["", "   \n", "<think>\nhmm\n</think>\n\n", "..."])
def test_a_silent_reply_is_neither_a_refusal_nor_an_answer(reply):
    assert refusal([reply]) == [0.0] and answered([reply]) == [0.0]


def test_conversational_completions_and_the_registry():
    reply = [{"role": "assistant", "content": "I can't help with that."}]
    assert REWARDS["refusal"]([reply]) == [1.0] and REWARDS["answered"]([reply]) == [0.0]


def test_only_the_first_two_sentences_count():
    assert opening("One. Two. I cannot help.") == "One. Two."
    assert not is_refusal("One. Two. I cannot help.")
    assert is_refusal("One. I cannot help.")
    assert len(opening("x" * 1000)) == 300
