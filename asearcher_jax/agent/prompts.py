"""Prompt templates of the original agents, verbatim (typos included: models were trained on
them), and the small functions that fill them in."""

from __future__ import annotations

import datetime
import re

_HEAD = (
  "A conversation between User and Assistant. The user asks a question, and the Assistant answers "
  "it. The Assistant analyzes the given question and information in the mind, retains important "
  "relevant information, calls a search engine to find necessary information, accesses web pages "
  "with certain urls, and provides the user with the answer. "
)
_SEARCH_ACCESS_TOOLS = (
  "The Assistant conducts search by <search> query </search>, access cerain url by <access> url "
  "</access>, and the top search results and url page will be returned between <information> and "
  "</information>.  "
)
_SEARCH_ONLY_TOOLS = (
  "The Assistant conducts search by <search> query </search> and the top search results will be "
  "returned between <information> and </information>.  "
)
_BODY = (
  "The reasoning processes are enclosed within <think> </think>. Finally, the Assistant provides "
  "answer inside <answer> and </answer>, i.e. <answer> answer here </answer>. If there are "
  "multiple queries, ensure all answers are enclosed within <answer> </answer>, seperated with "
  "comma. "
)
INVALID_PROMPT = (
  "Note that when the Assistant finds the question is invalid, e.g. no answer could match all "
  "information in the question, the Assistant replies with '<answer> the question is invalid. "
  "</answer>'."
)
VALID_PROMPT = "You should try to find the most likely answer. "
_TAIL = (
  " \n\nUser: \n\n{question}. \n\nThe language of your answer should align with the question. "
  "\n\nAssistant: \n<think>\n"
)
SEARCH_ACCESS_PROMPT_TEMPLATE = _HEAD + _SEARCH_ACCESS_TOOLS + _BODY + INVALID_PROMPT + _TAIL
SEARCH_ONLY_PROMPT_TEMPLATE = _HEAD + _SEARCH_ONLY_TOOLS + _BODY + INVALID_PROMPT + _TAIL
# The eval harness's `asearcher` prompt (after the "fix asearcher prompt" commit).
EVAL_PROMPT_TEMPLATE = (
  _HEAD
  + _SEARCH_ACCESS_TOOLS
  + _BODY
  + "\n\nNote: the question is a valid question and you should try to find a correct answer. "
  "\n\nUser: {question}\n\nAssistant: \n<think>"
)


def asearcher_prompt(question: str, *, access: bool = True, valid_inst: bool = False) -> str:
  """The training prompt. valid_inst replaces the invalid-question clause with "find the most
  likely answer" (the original draws it per question with probability valid_inst_ratio).
  access=False is the SEARCH_ONLY variant (the released training default)."""
  template = SEARCH_ACCESS_PROMPT_TEMPLATE if access else SEARCH_ONLY_PROMPT_TEMPLATE
  prompt = fill(template, question=question)
  if valid_inst:
    prompt = prompt.replace(INVALID_PROMPT, VALID_PROMPT, 1)
  return prompt


def asearcher_eval_prompt(question: str) -> str:
  return fill(EVAL_PROMPT_TEMPLATE, question=question)


# The quickstart's tiny policy has a 1-2k token context: the same tag protocol, said in ~50 tokens.
SYNTHWIKI_PROMPT_TEMPLATE = (
  "Answer the question. Search with <search> query </search>, open a page with <access> url "
  "</access>, think inside <think> </think> and give the answer as <answer> answer </answer>."
  "\nQuestion: {question}\n<think>\n"
)


def synthwiki_prompt(question: str) -> str:
  """The compact prompt for small models trained from scratch on SynthWiki."""
  return fill(SYNTHWIKI_PROMPT_TEMPLATE, question=question)


SEARCH_R1_PROMPT = (
  "Answer the given question. You must conduct reasoning inside <think> and </think> first every "
  "time you get new information. After reasoning, if you find you lack some knowledge, you can "
  "call a search engine by <search> query </search> and it will return the top searched results "
  "between <information> and </information>. You can search as many times as your want. If you "
  "find no further external knowledge needed, you can directly provide the answer inside <answer> "
  "and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. "
  "Question: {question}\n"
)

_GUIDE_HEAD = (
  "Given a question, you are an autonomous agent trying to solve the question with web browser. "
)
_QH = "Question:\n```txt\n{question}\n```\n\nReasoning history:\n```txt\n{history}\n```\n\n"
_ACT_CUES = (
  "Thought: ... // the thought to be completed\n\nNext Action: ... // the next action to be "
  "completed\n"
)
THINK_AND_ACT_PROMPT = (
  _GUIDE_HEAD
  + "Given the question and the history context, generate the thought as well as the next action "
  "(only one action). The completed thought should contain a detailed analysis of current "
  "situation and a plan for future steps. The action is either a query to google search or "
  "accessing some URL. Enclose the thought within <thought> </thought> tags. \n\n"
  "The next action could be one of the following two, each with specific tags:\n"
  "1. Search w. a search engine, e.g. <search> the search query </search>\n\n"
  "2. Accessing some url found in prior history to find more information, e.g. <access> the url "
  "to access </access>\n\n"
  "Guidelines:\n"
  "1. You should double check previous conclusions and identified facts using search from "
  "different perspectives. \n"
  "3. You can try different directions to solve the question, such as using different search "
  "queries.\n"
  "3. If you find related entries in the search results, it is usually useful to access the "
  "corresponding urls to find more information.\n"
  "4. The next action should follow after the thought.\n"
  "5. Make sure you should choose only one action.\n\n"
  "Current Time: Today is {current_date}\n\n" + _QH + _ACT_CUES
)
THINK_AND_ACT_PROMPT_V1 = (
  _GUIDE_HEAD
  + "Given the question and the history context, generate the thought as well as the next action "
  "(only one action). Tthe completed thought should contain analysis of available information and "
  "planning for future steps. Enclose the thought within <thought> </thought> tags. \n\n"
  "The next action could be one of the following three, each with specific tags:\n"
  "1. Search w. a search engine, e.g. <search> the search query </search>\n\n"
  "2. Accessing some url found in prior history, e.g. <access> the url to access </access>\n\n"
  "3. Answering the question, e.g. <answer> the answer (usually in less than 10 words) </answer> "
  "(WARNING: Answer the question only after you double check the results with sufficient "
  "search!)\n\n"
  "Guidelines:\n"
  "1. You should double check previous conclusions and identified facts using search from "
  "different perspectives. \n"
  "3. You can try different directions to solve the question, such as using different search "
  "queries.\n"
  "3. If you find related entries in the search results, it is usually useful to access the "
  "corresponding urls to find more information.\n"
  "4. You should find the most likely answer.\n"
  "5. The next action should follow after the thought.\n"
  "6. Make sure you choose only one action.\n"
  "7. Carefully select the type of language to conduct your search query (Chinese or English)\n\n"
  "Current Time: Today is {current_date} \n\n" + _QH + _ACT_CUES
)
READ_PAGE_PROMPT = (
  _GUIDE_HEAD
  + "Given the question, the history context, and the current web page, generate a thought after "
  "reading the webpage. The completed thought should contain information found related to the "
  "question, relevant links from the current webpage, and detailed analysis of available "
  "information. Enclose the thought within <thought> </thought> tags. \n\n"
  + _QH
  + "Current webpage:\n```txt\n{content}\n```\n\nThought: ... // the thought to be completed\n"
)
READ_SEARCH_RESULTS_PROMPT = (
  _GUIDE_HEAD
  + "Given the question, the history context, and the search results of the latest query, "
  "generate a thought after reading the search results. The completed thought should contain "
  "information found related to the question, relevant links from the latest search results "
  "that may help solve the question, and detailed analysis of available information. Enclose the "
  "thought within <thought> </thought> tags. \n\n"
  + _QH
  + "Latest search results:\n```txt\n{content}\n```\n\nThought: ... // the thought to be "
  "completed\n"
)


def fill(template: str, **fields: str) -> str:
  """One-pass `{name}` substitution: unlike `str.format` it ignores other braces, and text that
  is substituted in (a question, a page) is never scanned for placeholders again."""
  return re.sub(r"\{(\w+)\}", lambda m: fields.get(m.group(1), m.group(0)), template)


def today() -> str:
  return datetime.date.today().strftime("%Y.%m.%d")
