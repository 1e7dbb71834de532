"""Word lists and filler text for the generated tasks, written for kvlab.

RULER draws its keys from the ``wonderwords`` package; kvlab bundles its own short lists of common
English adjectives and nouns instead, so the tasks need no extra package and no download. Keys are
``adjective-noun`` pairs: with the lists below that gives over 20,000 distinct keys.
"""

from __future__ import annotations

ADJECTIVES: tuple[str, ...] = tuple(
    """
    able acidic active agile alert ancient angry anxious bald bare bitter blank bold bored brave
    breezy brief bright brisk broad bumpy busy calm careful cheap cheerful chilly clean clever close
    cloudy clumsy coarse cold cool cosy crisp cruel curly curved damp dark dear deep dense dirty
    dizzy dry dull dusty eager early easy elder empty equal even exact faint fair false famous fancy
    fast fierce fine firm flat fluffy fond free fresh friendly frozen funny fuzzy gentle giant glad
    glossy golden good grand great green grumpy happy hard harsh hasty heavy hollow honest huge
    humble hungry icy idle jolly juicy keen kind large late lazy light little lively lonely long
    loud loyal lucky magic mellow merry mighty mild modern moist narrow neat nervous new nice noble
    noisy odd old orange pale perfect plain plump polite poor proud purple quick quiet rapid rare raw
    ready real rich right rough round royal rusty sad safe salty sharp shiny short shy silent silly
    simple sleepy slim slow small smart smooth soft solid sour spare spicy steady steep sticky stiff
    still strange strict strong sunny super sweet swift tall tame tender thick thin tidy tiny tough
    true ugly upset vast violet warm weak wet white whole wide wild windy wise witty young zany
    """.split()
)

NOUNS: tuple[str, ...] = tuple(
    """
    acorn actor airport album anchor angle ankle apple apron arch arrow artist attic avenue badge
    bakery balloon banana banner barn basket beach beard bell bench berry bicycle blanket blossom
    boat bottle boulder branch bread bridge brush bucket button cabin cactus camera candle canoe
    canyon carpet castle cellar chair channel cherry chimney circle cliff clock cloud coast coffee
    comet compass cookie copper cottage crayon creek crown cup curtain daisy desert diamond dinner
    doctor dolphin dragon drawer drum eagle engine falcon farmer feather fence ferry finger forest
    fountain fox garden giraffe glacier glove goat guitar hammer harbor helmet hill honey horse
    island jacket jungle kettle kitten ladder lake lantern lemon library lion lizard magnet maple
    market meadow mirror monkey moon mountain needle nest ocean office orchard otter owl paddle
    palace panda parrot pebble pencil pepper piano pillow planet pocket pond potato puppy quilt
    rabbit radio raven ribbon river robot rocket saddle sailor salmon scarf shadow shelf shell ship
    shovel singer sketch spoon squirrel stamp statue stove stream student sugar table teacher temple
    thunder tiger tomato tower tractor train tulip tunnel turtle valley violin wagon walrus wallet
    whale window winter wizard wolf yacht zebra
    """.split()
)

# The RULER "noise" haystack: a fixed filler repeated one copy per line. The sentences are plain
# facts a small model has no reason to attend to.
NOISE_LINE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
