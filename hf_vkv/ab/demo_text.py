"""The texts of ``hf-vkv demo``: a shared document with a question about it, and a short prompt.

The document is an invented handbook (about 1k tokens with SmolLM2's tokenizer and chat
template); every row of the demo's beam search and sampling runs starts with all of it, which is
the workload where a cache that stores a shared prompt once matters.
"""

from __future__ import annotations

__all__ = ["DOCUMENT", "QUESTION", "SHORT_PROMPT", "document_prompt"]

#: The short prompt of the greedy row (45 tokens with the chat template).
SHORT_PROMPT = "Explain in two sentences why a key-value cache makes text generation faster."

QUESTION = ("Using only the handbook above: how many volunteer hours does a member owe each month, and what "
            "happens when a member misses them?")

DOCUMENT = """\
Harbor Light Food Cooperative: Member Handbook (fourth edition)

1. Who we are
Harbor Light is a food cooperative owned by the people who shop in it. It opened in a former
ship chandlery on Quay Street and now has about nine hundred member households. The store sells
groceries at cost plus a fixed margin of eighteen percent, which pays for rent, electricity, the
two paid managers and the delivery van. Surplus at the end of the year is either returned to
members in proportion to their purchases or put into the building fund, as the annual meeting
decides. Non-members may shop on Saturdays only and pay the shelf price plus ten percent.

2. Becoming a member
Any adult living within the county may join. A household buys one membership share for one
hundred and twenty dollars, which can be paid at once or in six monthly instalments of twenty
dollars. The share is returned in full when the household leaves, minus any unpaid purchases. A
household names up to three adults on its card; all of them may shop and all of them may
work the household's shifts. Students enrolled at the harbor college pay a reduced share of
forty dollars and work the same hours as everyone else.

3. Volunteer work
The cooperative runs on the work of its members. Every member household owes three hours of
volunteer work each calendar month. Work is done in shifts of one and a half hours, so most
households sign up for two shifts a month. Shifts include stocking shelves, running a till,
receiving the Tuesday and Friday deliveries, cleaning the cold room, bookkeeping, and driving
the van to the two farms that supply eggs and vegetables. Members sign up on the board next to
the office or through the cooperative's website, and can swap a shift with another member as
long as both names are changed on the board before the shift starts.

A household that misses its hours in a month is placed on "make-up" status. On make-up status
the household may keep shopping, but it must work the missing hours plus one extra shift within
the following two months. A household that is still behind after those two months has its card
suspended: it may not shop until the hours are made up, and its share is not returned while the
card is suspended. Members who are ill, who have a new baby, or who are caring for a relative
can ask the membership committee for a leave of up to six months, during which no hours are
owed. Members over seventy owe half the usual hours.

4. Shopping
Members scan their card at the till; the discount is applied automatically. Bulk goods are
weighed at the scale by the door and labelled with the bin number. Bring your own jars and bags:
the cooperative sells paper bags for twenty cents each and gives the money to the harbor school
garden. Special orders of whole cases are placed on Mondays and arrive with the Friday delivery;
a case must be paid for when it is ordered. Members may run a monthly tab of up to one hundred
dollars, settled by the fifth day of the next month.

5. Governance
The cooperative is governed by a board of seven members elected at the annual meeting in March
for two-year terms, with three or four seats up each year. Any member household has one vote,
whatever the number of adults on its card. The board appoints the two managers and sets the
margin, but a change of more than two percentage points needs a vote of the annual meeting. The
minutes of every board meeting are posted on the board by the office within a week. Committees
for membership, finance, buying, and the building report to the board every month.

6. Safety and cleanliness
The cold room must stay between one and four degrees Celsius. Whoever opens the store reads the
thermometer and writes the reading in the log; a reading above five degrees means the manager on
call must be phoned at once. Volunteers wash their hands before handling bulk goods and wear
gloves when cutting cheese. Knives are kept in the locked drawer under the deli counter. The van
may be driven only by members who have shown their licence to the office and completed one
supervised trip.

7. Leaving the cooperative
A household that wishes to leave writes to the membership committee. The share is returned within
thirty days, by bank transfer or in store credit, as the household prefers. Unused store credit
does not expire. A household that has left may rejoin at any time by buying a new share.
"""


def document_prompt() -> str:
    """The user message of the document rows: the handbook, then the question."""
    return f"{DOCUMENT}\n{QUESTION}"
