"""The long natural text of `mtpchat bench --prompt-tokens N` with a model: MTP acceptance measured on a long
prompt of ordinary prose (a summary asked of it), not on synthetic ids. Written for mtpchat and dedicated to the
public domain (CC0). About 1,000 words (1,428 tokens for the demo model); longer prompts repeat it (the bench JSON
says how many times)."""

TEXT = """\
The harbour town of Wenlow sits where a slow river meets a cold and restless sea. For most of its history it was a
place that people passed through rather than a place they chose. Fishing boats came in at dawn with their holds
full of herring, the catch was salted on the quay, and by the afternoon carts were already on the road inland.
The town itself was a handful of stone houses, two chapels, a customs office and a long row of sheds that smelled
of tar and brine in every season.

The lighthouse on the northern headland was built in the year of the great storm, after three ships were lost on
the rocks within a single night. The first keeper was a retired sailor named Tomas Hale, who kept a journal of
every ship he saw and every change in the weather. His entries are short and plain. "Wind from the west, strong.
Two sails at noon, one a collier. Lamp trimmed at dusk. Rain after midnight." Read one after another, they give a
clear picture of how much of a keeper's life was patience: watching, waiting, and doing the same small tasks with
care, night after night, because a single careless evening could cost lives.

Hale's daughter Mary took over the light when he grew too old to climb the tower. She was the first to write down
not only the ships but the birds that nested on the cliffs, the dates on which the ice formed in the river mouth,
and the names of the families who brought supplies along the cliff path. Historians value her journals because
they record the town as it changed. In her time the railway reached Wenlow, and with it came visitors from the
cities who wanted sea air and a view of the waves. The customs office became a hotel. The salting sheds were
turned into workshops, and later into shops that sold postcards, shells and painted pottery.

Not everyone welcomed the change. The fishing families complained that the visitors crowded the quay and did not
understand the work that happened there. A letter printed in the county newspaper asked whether the town wished
to be a harbour or a picture of a harbour. The question was never fully answered. Instead, the town learned to be
both. In the early morning the boats still came in and the catch was still sold on the quay. By ten o'clock the
nets were folded, the quay was washed down, and the first visitors arrived with their cameras and their
questions.

The river shaped the town as much as the sea did. Its water is brown with peat from the moors, and after heavy
rain it carries branches, leaves and sometimes whole trees down to the harbour mouth. Twice in the last century it
flooded the lower streets. After the second flood the town built a stone wall along the bank and a set of gates
that can be closed when the tide and the river rise together. Older residents still remember carrying furniture
up the stairs while the water rose through the floorboards, and they point out the marks on the church wall that
show how high it came.

Life in the town follows the seasons closely. In winter the hotels close, the shops open only on market days, and
the streets belong again to the people who live there. The wind can blow for a week without stopping, and the
boats stay in the harbour when the sea is too rough. People mend nets, repair roofs and visit one another in the
evenings. In spring the birds return to the cliffs, the gardens behind the houses are dug and planted, and the
first visitors arrive on the weekend trains. Summer is busy and loud. Autumn brings the herring, the storms and a
long, quiet settling back into the rhythm of the year.

The school in Wenlow has never had more than sixty pupils. For many years it had a single teacher, a woman named
Ellen Carr, who taught reading, arithmetic, geography and music to children from five to fourteen in one long
room heated by an iron stove. She was known for taking her pupils out of the classroom whenever the weather
allowed. They measured the height of the tide against the harbour steps, counted the boats, drew maps of the
headland and learned the names of the plants that grew along the cliff path. Many of her former pupils later said
that they learned more on those walks than from any book.

Today the lighthouse is automatic. Its lamp is switched on by a sensor at dusk and watched from an office many
miles away. The keeper's cottage has become a small museum, where the journals of Tomas and Mary Hale are kept in
a glass case beside the old brass lamp, a telescope and a chart of the coast marked with the places where ships
were lost. Visitors can climb the tower on summer afternoons. From the top they can see the whole curve of the
bay, the river winding back toward the hills, and the town itself, small and grey, gathered around its harbour as
it has been for centuries.

What makes Wenlow worth knowing is not any single building or event. It is the way the town has held on to its
working life while learning to share it with strangers. The boats, the river, the school and the lighthouse each
tell part of the same story: a small community living close to forces much larger than itself, adapting when it
had to, and keeping a careful record of what it saw. The journals in the museum end with a line that Mary Hale
wrote on her last night in the tower. "Wind falling. Sea calm. The light will be kept."
"""
