"""`clients.needle`'s documents: what each form plants, where, and what the message says up front."""

from clients.needle import CITIES, FORMS, NAMES, Place, SUMMARIZE, TURN_REPLY, TURN_WORDS, converse, document, filler_words, later_turns, message, passage_start, system_messages

WORDS = [f"w{i}" for i in range(5000)]


def test_the_code_form_states_the_code_once_at_its_depth_in_a_piece_that_differs_per_key():
    text = document("code", WORDS, 1000, 0.5, 123456, index=3)
    words = text.split()
    assert text.count("123456") == 1 and len(words) == 1000 + len("Staff were told that the access code for the north gate is 123456.".split())
    at = words.index("Staff")
    before, after = int(words[at - 1][1:]), int(words[at + 13][1:])
    assert at == 500 and after == before + 1  # the sentence sits between two halves of one run of words
    assert document("code", WORDS, 1000, 0.5, 123456, index=4).split()[0] != words[0]
    assert document("code", WORDS, 1000, 0.5, 123456, index=3) == text  # the same key's place: the same text


def test_the_code_form_says_nothing_up_front_and_the_passkey_form_does():
    code = message("code", "some text")
    assert code.startswith("some text") and code.endswith(FORMS["code"].question) and "hidden" not in code
    passkey = message("passkey", document("passkey", WORDS, 100, 0.25, 54321))
    assert passkey.startswith("There is a pass key hidden") and passkey.count("54321") == 2


def test_asked_first_the_question_comes_before_the_text_and_after_what_is_said_up_front():
    code = message("code", "some text", ask_first=True)
    assert code == f"{FORMS['code'].question}\n\nsome text"
    passkey = message("passkey", "some text", ask_first=True)
    assert passkey == f"{FORMS['passkey'].intro}\n\n{FORMS['passkey'].question}\n\nsome text"
    assert message("code", "some text") == f"some text\n\n{FORMS['code'].question}"


def test_asking_first_is_a_form_of_one_message(fake_server):
    from tests.clients.conftest import run_client
    bad = run_client("needle", "--base-url", fake_server, "--ask-first", "--turns", "2")
    assert bad.returncode == 2 and "--ask-first" in bad.stderr


def test_in_a_system_message_the_text_comes_first_and_the_user_asks_alone():
    code = system_messages("code", "some text")
    assert code == [{"role": "system", "content": "some text"}, {"role": "user", "content": FORMS["code"].question}]
    passkey = system_messages("passkey", "some text")
    assert passkey[0]["content"] == f"{FORMS['passkey'].intro}\n\nsome text"
    assert passkey[1] == {"role": "user", "content": FORMS["passkey"].question}


def test_a_system_message_is_asked_about_in_the_next_turn_and_the_table_says_so():
    """A fake model that reads only the last message (the user's turn) finds the code where the text
    is in that message, and not where it went to the system message before it."""
    import re

    from tests.clients.conftest import run_client, serve
    from tests.clients.fake_server import make_app
    server, url = serve(make_app(answer=lambda content: re.findall(r"\b\d{6}\b", content)[:1] or ["none"]))
    try:
        args = ("needle", "--base-url", url, "--form", "code", "--words", "50", "--depths", "0.5", "--keys", "2")
        in_turn, in_system = run_client(*args), run_client(*args, "--system")
        assert in_turn.returncode == 0 and in_system.returncode == 0, in_turn.stderr + in_system.stderr
        assert "in a system message, asked in the user's turn" in in_system.stdout
        rows = [next(line for line in run.stdout.splitlines() if line.startswith("| 50 |")).split("|")
                for run in (in_turn, in_system)]
        # both sent the whole document and the question (the fake server counts their words) ...
        words = 50 + len(FORMS["code"].sentence.split()) + len(FORMS["code"].question.split())
        assert int(rows[0][2]) == int(rows[1][2]) == words
        # ... but only the user's turn of one message held the code
        assert float(rows[0][4]) == 1.0 and float(rows[1][4]) == 0.0
        for other in (("--ask-first",), ("--turns", "2")):
            bad = run_client("needle", "--base-url", url, "--system", *other)
            assert bad.returncode == 2 and "--system" in bad.stderr
    finally:
        server.should_exit = True


def test_the_place_form_plants_a_city_s_best_thing_to_do_once_and_asks_for_that_city():
    import random
    keys = FORMS["place"].keys(random.Random(0), len(CITIES))
    assert len({key.city for key in keys}) == len({key.word for key in keys}) == len(CITIES)
    key = keys[0]
    assert key.word in key.activity
    text = document("place", WORDS, 1000, 0.5, key, index=2)
    assert text.count(key.activity) == 1 and text.split().index("best") == 501  # "The" sits at word 500
    asked = message("place", text, key=key)
    assert asked.endswith(f"What is the best thing to do in {key.city}?")
    assert system_messages("place", text, key)[1]["content"] == f"What is the best thing to do in {key.city}?"
    place = FORMS["place"]
    assert place.found(key, f"The best thing is to {key.word.capitalize()}!")  # in any case
    assert not place.found(key, f"The best thing to do in {key.city} is to stay home.")
    assert FORMS["code"].found(123456, "it is 123456.") and not FORMS["code"].found(123456, "it is 12345.")


def test_a_place_is_found_by_its_activity_s_word_and_the_question_names_its_city():
    """A fake model that answers with what the last message says is the best thing to do in the city
    its question names finds every place; the table says what a hit is."""
    import re

    from tests.clients.conftest import run_client, serve
    from tests.clients.fake_server import make_app

    def best_thing(content: str) -> list[str]:
        city = re.search(r"to do in (\w+)\?$", content).group(1)
        told = re.search(rf"to do in {city} is to ([^.]*)\.", content)
        return told.group(1).split() if told else ["none"]

    server, url = serve(make_app(answer=best_thing))
    try:
        run = run_client("needle", "--base-url", url, "--form", "place", "--words", "60", "--depths", "0.3", "0.8",
                         "--keys", "3")
        assert run.returncode == 0, run.stderr
        assert "A city's best thing to do stated once in news articles" in run.stdout
        assert "| mean | | | 1.00 |" in run.stdout
        bad = run_client("needle", "--base-url", url, "--form", "place", "--keys", str(len(CITIES) + 1))
        assert bad.returncode == 2 and "--keys" in bad.stderr
    finally:
        server.should_exit = True


def test_a_json_lines_filler_gives_its_documents_words_in_order(tmp_path):
    news = tmp_path / "news.jsonl"
    news.write_text('{"document": "One story\\nends.", "summary": "a"}\n{"document": "Another.", "summary": "b"}\n')
    assert filler_words(news) == ["One", "story", "ends.", "Another."]
    novel = tmp_path / "novel.txt"
    novel.write_text("Chapter I\n\nIt was")
    assert filler_words(novel) == ["Chapter", "I", "It", "was"]


def test_varied_pass_keys_sit_in_passages_of_their_own_at_their_depth():
    starts = [passage_start(WORDS, 1000, i) for i in range(4)]
    assert starts[0] == 0 and len(set(starts)) == 4 and all(0 <= s <= len(WORDS) - 1000 for s in starts)
    for start in starts:
        words = document("passkey", WORDS, 1000, 0.25, 54321, starts.index(start), vary=True).split()
        at = words.index("The")
        assert words[0] == f"w{start}" and at == 250 and words[at - 1] == f"w{start + 249}" and words[at + 12] == f"w{start + 250}"
        assert len(words) == 1000 + 12  # the needle's 12 words
    # unvaried: every key in the first words
    assert document("passkey", WORDS, 100, 0.5, 7, index=3).split()[0] == "w0" == document("passkey", WORDS, 100, 0.5, 7).split()[0]


def test_the_name_form_names_the_cat_once_at_its_depth_and_asks_in_other_words():
    text = document("name", WORDS, 1000, 0.85, "Mortimer", index=2)
    words = text.split()
    assert text.count("Mortimer") == 1 and len(words) == 1000 + 16
    at = words.index("crew's") - 1
    assert at == 850 and int(words[at + 16][1:]) == int(words[at - 1][1:]) + 1  # between two halves of one run
    assert text.split()[0] != document("code", WORDS, 1000, 0.85, 1, index=2).split()[0]
    asked = message("name", text)
    question = FORMS["name"].question
    assert asked.endswith(question) and "hidden" not in asked and "named" not in question


def test_the_name_form_s_names_are_distinct_and_none_is_in_the_articles():
    from tests.conftest import shared_data

    articles = " ".join(filler_words(shared_data("xsum_dev.jsonl")))
    assert len(set(NAMES)) == len(NAMES) == 20
    assert [name for name in NAMES if name in articles] == []  # a hit can only come from the planted sentence


def test_the_turns_after_a_document_paste_other_words_and_ask_for_a_summary():
    later = later_turns(WORDS, index=1, turns=3)
    assert len(later) == 3 and all(m.endswith(SUMMARIZE) for m in later)
    pieces = [m[:-len(SUMMARIZE)].split() for m in later]
    assert all(len(p) == TURN_WORDS for p in pieces) and len({p[0] for p in pieces}) == 3
    document_words = set(document("code", WORDS, 1000, 0.5, 123456, index=1).split())
    assert not document_words & {w for p in pieces for w in p}  # other articles than the document's
    assert later_turns(WORDS, index=2, turns=3)[0] != later[0]  # each key's conversation its own


def test_a_conversation_sends_the_whole_history_and_asks_the_question_alone_last(fake_server):
    import httpx
    text = document("code", WORDS, 200, 0.5, 654321, index=0)
    later = later_turns(WORDS, 0, 2)
    with httpx.Client(timeout=30) as client:
        reply, tokens = converse(client, fake_server, "code", text, later, max_tokens=5)
    assert reply.split() == ["w0", "w1", "w2", "w3", "w4"]
    # the fake server counts the words of every message it was sent: the document with its request, the
    # two later messages, three replies of TURN_REPLY words and the question
    question = FORMS["code"].question
    words = len(f"{text}\n\n{SUMMARIZE}".split()) + sum(len(m.split()) for m in later) + 3 * TURN_REPLY + len(question.split())
    assert tokens == words


def test_turns_are_counted_from_zero(fake_server):
    from tests.clients.conftest import run_client
    bad = run_client("needle", "--base-url", fake_server, "--turns", "-1")
    assert bad.returncode == 2 and "--turns" in bad.stderr


def test_the_table_names_the_filler_of_the_code_form(fake_server, tmp_path):
    from tests.clients.conftest import run_client
    novel = tmp_path / "novel.txt"
    novel.write_text(" ".join(f"word{i}" for i in range(3000)))
    run = run_client("needle", "--base-url", fake_server, "--form", "code", "--xsum", str(novel), "--words", "50",
                     "--depths", "0.5", "--keys", "1")
    assert run.returncode == 0, run.stderr
    assert "A 6-digit code stated once in novel.txt in one message" in run.stdout


def test_each_miss_is_printed_with_its_key_and_what_the_reply_said():
    """A miss is worth reading (a lost fact reads differently from a derailed reply): stderr names each
    missed key and the reply's start; found keys print no miss."""
    import re

    from tests.clients.conftest import run_client, serve
    from tests.clients.fake_server import make_app

    def answer(content: str) -> list[str]:
        code = re.search(r"code for the north gate is (\d+)", content).group(1)
        return [code] if int(code) % 2 else ["I", "am", "here", "to", "help"]

    server, url = serve(make_app(answer=answer))
    try:
        run = run_client("needle", "--base-url", url, "--form", "code", "--words", "80", "--depths", "0.5",
                         "--keys", "6")
        assert run.returncode == 0, run.stderr
        misses = re.findall(r"miss: key (\d+) \((\d+)\): '(.*)'", run.stderr)
        assert misses and all(int(code) % 2 == 0 for _, code, _ in misses)
        assert all(said.startswith("I am here to help") for _, _, said in misses)
        hits = 6 - len(misses)
        assert f"depth 50%: {hits}/6" in run.stderr
    finally:
        server.should_exit = True
