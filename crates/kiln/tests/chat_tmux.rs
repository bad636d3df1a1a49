//! `kiln chat` on a real terminal: driven through tmux on SmolLM2 (greedy),
//! a pasted three-line message is one turn, a blank line does not quit,
//! Ctrl-C stops an answer and the session goes on, and Ctrl-D or Ctrl-C
//! twice at the prompt quits cleanly, and a second turn (typed ahead while
//! the first answer streams) is prefilled only past what the prefix cache
//! holds. Needs tmux (`apt-get install -y tmux`; scripts/test.sh installs
//! it).

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// Long enough for a debug build to load the model and answer.
const WAIT: Duration = Duration::from_secs(300);

fn smollm2() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-models.sh first",
        p.display()
    );
    p
}

/// A private tmux server with one pane running `kiln chat`.
struct Tmux {
    socket: String,
    dir: PathBuf,
}

impl Tmux {
    /// Starts `kiln chat ARGS` in a 160×50 pane whose HOME is a fresh
    /// directory (so the history file is the test's own).
    fn chat(name: &str, args: &[&str]) -> Self {
        let version = Command::new("tmux").arg("-V").output();
        assert!(
            version.is_ok_and(|o| o.status.success()),
            "tmux is missing: install it (`apt-get install -y tmux`; scripts/test.sh does)"
        );
        let socket = format!("kiln-chat-{name}-{}", std::process::id());
        let dir = std::env::temp_dir().join(&socket);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let conf = dir.join("tmux.conf");
        std::fs::write(
            &conf,
            "set -g remain-on-exit on\nset -g history-limit 50000\n",
        )
        .unwrap();
        // The pane's shell waits for `kiln chat` and writes its exit status
        // to a file: tmux 3.3 does not always reap a pane's process, so its
        // `pane_dead_status` can stay empty for good. The shell catches
        // SIGINT with a no-op trap, so it outlives a Ctrl-C meant for the
        // chat, whose own disposition stays the default (a caught signal is
        // reset on exec; an ignored one would not be).
        let mut command = format!(
            "trap : INT; env HOME='{}' TERM=xterm '{}' --threads 2 chat -m '{}'",
            dir.display(),
            env!("CARGO_BIN_EXE_kiln"),
            smollm2().display()
        );
        for a in args {
            command.push_str(&format!(" '{a}'"));
        }
        command.push_str(&format!(
            "; echo $? > '{}.tmp' && mv '{0}.tmp' '{0}'",
            dir.join("status").display()
        ));
        let t = Tmux { socket, dir };
        let out = t.run(&[
            "-f",
            conf.to_str().unwrap(),
            "new-session",
            "-d",
            "-s",
            "chat",
            "-x",
            "160",
            "-y",
            "50",
            &command,
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        t
    }

    fn run(&self, args: &[&str]) -> Output {
        Command::new("tmux")
            .arg("-L")
            .arg(&self.socket)
            .args(args)
            .output()
            .unwrap()
    }

    fn keys(&self, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", "chat"];
        args.extend_from_slice(keys);
        assert!(self.run(&args).status.success());
    }

    /// Types `text` and presses Enter.
    fn type_line(&self, text: &str) {
        let out = self.run(&["send-keys", "-t", "chat", "-l", text]);
        assert!(out.status.success());
        self.keys(&["Enter"]);
    }

    /// Pastes `text` as a terminal paste (bracketed, when the program asked
    /// for it) and presses Enter.
    fn paste_line(&self, text: &str) {
        let file = self.dir.join("paste.txt");
        std::fs::write(&file, text).unwrap();
        let out = self.run(&["load-buffer", "-b", "p", file.to_str().unwrap()]);
        assert!(out.status.success());
        assert!(self
            .run(&["paste-buffer", "-p", "-d", "-b", "p", "-t", "chat"])
            .status
            .success());
        self.keys(&["Enter"]);
    }

    /// The pane's whole text, wrapped lines joined.
    fn screen(&self) -> String {
        let out = self.run(&["capture-pane", "-p", "-J", "-S", "-", "-t", "chat"]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The exit status of `kiln chat`, once it has exited: `"N"`, or
    /// `"128+N"` for a kill by signal N (as the shell reports it).
    fn exit_status(&self) -> Option<String> {
        std::fs::read_to_string(self.dir.join("status"))
            .ok()
            .map(|s| s.trim().to_string())
    }

    /// Polls the screen until `done` holds; fails with the screen after
    /// [`WAIT`].
    fn wait_for(&self, what: &str, done: impl Fn(&str) -> bool) -> String {
        let start = Instant::now();
        loop {
            let screen = self.screen();
            if done(&screen) {
                return screen;
            }
            assert!(
                start.elapsed() < WAIT && self.exit_status().is_none(),
                "waiting for {what}; the pane shows:\n{screen}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Waits for the `n`th prompt, empty and last on the screen.
    fn wait_for_prompt(&self, n: usize) -> String {
        self.wait_for(&format!("prompt {n}"), |s| {
            num_prompts(s) >= n && last_line(s) == ">>>"
        })
    }

    /// Waits for `kiln chat` to exit; its exit status.
    fn wait_for_exit(&self) -> String {
        let start = Instant::now();
        loop {
            if let Some(status) = self.exit_status() {
                return status;
            }
            assert!(
                start.elapsed() < WAIT,
                "kiln chat did not quit:\n{}",
                self.screen()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Saves the conversation through `/save` and reads it back.
    fn saved(&self, name: &str) -> serde_json::Value {
        let path = self.dir.join(name);
        self.type_line(&format!("/save {}", path.display()));
        self.wait_for("the saved conversation", |s| {
            s.contains("(saved to") && last_line(s) == ">>>" && path.exists()
        });
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.run(&["kill-server"]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn num_prompts(screen: &str) -> usize {
    screen.lines().filter(|l| l.starts_with(">>>")).count()
}

fn last_line(screen: &str) -> &str {
    screen
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim()
}

/// Non-blank characters after the last line that shows `question`.
fn answer_chars(screen: &str, question: &str) -> usize {
    match screen.rfind(question) {
        Some(i) => screen[i + question.len()..]
            .chars()
            .filter(|c| !c.is_whitespace())
            .count(),
        None => 0,
    }
}

fn messages_by_role<'a>(saved: &'a serde_json::Value, role: &str) -> Vec<&'a serde_json::Value> {
    saved["messages"]
        .as_array()
        .expect("saved messages")
        .iter()
        .filter(|m| m["role"] == role)
        .collect()
}

#[test]
fn a_pasted_three_line_message_is_one_turn() {
    let t = Tmux::chat("paste", &["--max-tokens", "48"]);
    t.wait_for_prompt(1);
    // A blank line is no message, and does not quit.
    t.keys(&["Enter"]);
    t.wait_for_prompt(2);
    let pasted = "Name three colors.\nAnswer in one line.\nThank you.";
    t.paste_line(pasted);
    let screen = t.wait_for_prompt(3);
    // The continuation lines were not prompts of their own.
    assert_eq!(num_prompts(&screen), 3, "{screen}");
    let saved = t.saved("paste.json");
    let users = messages_by_role(&saved, "user");
    assert_eq!(users.len(), 1, "{saved}");
    assert_eq!(users[0]["content"], pasted);
    let answers = messages_by_role(&saved, "assistant");
    assert_eq!(answers.len(), 1, "{saved}");
    assert!(
        !answers[0]["content"].as_str().unwrap().trim().is_empty(),
        "{saved}"
    );
    // The history file keeps the message whole.
    let history = std::fs::read_to_string(t.dir.join(".cache/kiln/chat_history")).unwrap();
    assert!(history.contains("Name three colors."), "{history}");
    t.keys(&["C-d"]);
    assert_eq!(t.wait_for_exit(), "0", "{}", t.screen());
}

#[test]
fn ctrl_c_stops_an_answer_and_the_session_goes_on() {
    // An answer that would run to the context's end: only Ctrl-C stops it.
    let t = Tmux::chat("interrupt", &["--max-tokens", "100000", "--ignore-eos"]);
    t.wait_for_prompt(1);
    let story = "Tell me a long story about a dragon.";
    t.type_line(story);
    t.wait_for("the story to stream", |s| answer_chars(s, story) > 40);
    t.keys(&["C-c"]);
    let screen = t.wait_for_prompt(2);
    assert!(screen.contains("[interrupted]"), "{screen}");

    // The next message is answered, in the same session.
    let question = "What is the capital of France?";
    t.type_line(question);
    t.wait_for("the second answer to stream", |s| {
        answer_chars(s, question) > 20
    });
    t.keys(&["C-c"]);
    t.wait_for_prompt(3);
    let saved = t.saved("interrupted.json");
    let users = messages_by_role(&saved, "user");
    let answers = messages_by_role(&saved, "assistant");
    assert_eq!(users.len(), 2, "{saved}");
    assert_eq!(users[1]["content"], question);
    assert_eq!(answers.len(), 2, "{saved}");
    for a in answers {
        assert!(!a["content"].as_str().unwrap().trim().is_empty(), "{saved}");
    }

    // Ctrl-C twice at the prompt quits.
    t.keys(&["C-c"]);
    t.wait_for("the hint to quit", |s| s.contains("Ctrl-C again"));
    t.keys(&["C-c"]);
    assert_eq!(t.wait_for_exit(), "0", "{}", t.screen());
}

#[test]
fn a_second_turn_prefills_only_what_the_cache_lacks() {
    let t = Tmux::chat(
        "cache",
        &[
            "--max-tokens",
            "24",
            "--verbose",
            "--system",
            &"Be brief. ".repeat(20),
        ],
    );
    t.wait_for_prompt(1);
    t.type_line("Name a color.");
    // Typed ahead while the first answer is coming: the editor reads it
    // whole when the next prompt opens (many keys in one read). Typed once
    // the answer has begun: keys sent while the editor still held the
    // terminal for the first line could be lost with its mode switch.
    t.wait_for("the first answer to begin", |screen| {
        let mut lines = screen.lines().skip_while(|l| !l.ends_with("Name a color."));
        lines.next().is_some() && lines.next().is_some_and(|l| !l.trim().is_empty())
    });
    t.type_line("Name another one.");
    let screen = t.wait_for_prompt(3);
    // `[N prompt tokens (C from the cache), ...]` after each answer.
    let cached: Vec<(usize, usize)> = screen
        .lines()
        .filter_map(|l| {
            let (n, rest) = l.strip_prefix('[')?.split_once(" prompt tokens (")?;
            let (c, _) = rest.split_once(" from the cache")?;
            Some((n.parse().ok()?, c.parse().ok()?))
        })
        .collect();
    assert_eq!(cached.len(), 2, "{screen}");
    assert_eq!(
        cached[0].1, 0,
        "nothing cached on the first turn:\n{screen}"
    );
    let (prompt, from_cache) = cached[1];
    // The system message and the first turn (at least 120 tokens) come from
    // the cache, to the last whole block before the first difference.
    assert!(
        from_cache >= cached[0].0 - 16 && from_cache < prompt,
        "second turn: {from_cache} of {prompt} prompt tokens cached:\n{screen}"
    );
    t.keys(&["C-d"]);
    assert_eq!(t.wait_for_exit(), "0", "{}", t.screen());
}
