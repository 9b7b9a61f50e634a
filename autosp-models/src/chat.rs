//! Chat templates: a conversation (`[{"role": .., "content": ..}, ..]`) rendered with the model's own Jinja
//! template (`tokenizer_config.json`'s `chat_template`, a `chat_template.jinja` beside it, or a GGUF file's
//! `tokenizer.chat_template`) as transformers' `apply_chat_template` renders it, and tokenised with a mask of
//! the assistant's tokens (the ones supervised fine-tuning trains on).
//!
//! The mask needs no markup in the template. For each assistant turn `i` the conversation up to it is
//! rendered with the generation prompt (`add_generation_prompt`: what the model sees before it answers) and
//! up to and including it; the characters between the two are the answer (its end-of-turn tokens included),
//! and every token overlapping them is trained. This holds for any template that renders earlier turns the
//! same whatever follows (ChatML, Llama 3, Gemma, Mistral); one that does not (Qwen3 drops earlier turns'
//! reasoning) is refused. `{% generation %}` tags, which transformers reads for its own mask, are skipped.

use std::path::Path;

use minijinja::{context, Environment, Error as JinjaError, ErrorKind};
use serde_json::Value;

use crate::error::{Error, Result};
use crate::Tokenizer;

/// A model's chat template with the special tokens it refers to.
#[derive(Clone, Debug)]
pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
}

/// `tokenizer_config.json`'s `bos_token`/`eos_token`: a string or `{"content": ..}`.
fn token_text(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(m)) => m.get("content").and_then(Value::as_str).unwrap_or_default().to_string(),
        _ => String::new(),
    }
}

/// The template without transformers' `{% generation %}` / `{% endgeneration %}` tags (minijinja has no such
/// tag; the mask is found without them).
fn without_generation_tags(t: &str) -> String {
    let mut out = String::with_capacity(t.len());
    let mut rest = t;
    while let Some(start) = rest.find("{%") {
        let Some(len) = rest[start..].find("%}") else { break };
        let inner = rest[start + 2..start + len].trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        out.push_str(&rest[..start]);
        if inner != "generation" && inner != "endgeneration" {
            out.push_str(&rest[start..start + len + 2]);
        }
        rest = &rest[start + len + 2..];
    }
    out.push_str(rest);
    out
}

fn template_error(source: &str, e: JinjaError) -> Error {
    Error::Tokenizer { source_name: format!("{source} (chat template)"), message: e.to_string() }
}

impl ChatTemplate {
    /// A template from its Jinja source and the text of the model's BOS and EOS tokens (what templates call
    /// `bos_token` and `eos_token`). Fails when the template does not parse.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let t =
            Self { source: without_generation_tags(source), bos_token: bos_token.into(), eos_token: eos_token.into() };
        t.environment().template_from_str(&t.source).map_err(|e| template_error("the model", e))?;
        Ok(t)
    }

    /// The chat template of the tokenizer whose `tokenizer.json` is `tokenizer_json`: `chat_template` in the
    /// `tokenizer_config.json` beside it (a string, or the `default` of a list of named templates), else a
    /// `chat_template.jinja` there. `None` when the model has none.
    pub fn beside_tokenizer(tokenizer_json: &Path) -> Result<Option<Self>> {
        let dir = tokenizer_json.parent().unwrap_or(Path::new("."));
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: Value = match std::fs::read_to_string(&cfg_path) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|e| Error::Json { path: cfg_path.clone(), message: e.to_string() })?,
            Err(_) => Value::Null,
        };
        let (bos, eos) = (token_text(cfg.get("bos_token")), token_text(cfg.get("eos_token")));
        let source = match cfg.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
            _ => std::fs::read_to_string(dir.join("chat_template.jinja")).ok(),
        };
        source.map(|s| Self::new(&s, &bos, &eos)).transpose()
    }

    /// A `tokenizer_config.json` holding this template and its BOS and EOS (for a model whose tokenizer came
    /// from elsewhere: a GGUF file).
    pub fn to_tokenizer_config(&self) -> String {
        let doc = serde_json::json!({
            "chat_template": self.source,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        });
        serde_json::to_string_pretty(&doc).expect("a JSON map always serialises")
    }

    /// The environment transformers gives templates: Python's string methods, `raise_exception`, trimmed
    /// blocks and stripped block indentation.
    fn environment(&self) -> Environment<'static> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build();
        env.set_syntax(syntax.expect("the default delimiters are valid"));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, JinjaError> {
            Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
        });
        env
    }

    /// The text of `messages` (a JSON array of `{"role", "content"}` objects), with the assistant's generation
    /// prompt at the end when `add_generation_prompt`.
    pub fn render(&self, messages: &[Value], add_generation_prompt: bool) -> Result<String> {
        let env = self.environment();
        let t = env.template_from_str(&self.source).map_err(|e| template_error("the model", e))?;
        t.render(context! {
            messages => minijinja::Value::from(minijinja::value::Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(|e| template_error("rendering a conversation with the model", e))
    }

    /// The token ids of `messages` rendered (tokenised as transformers' `apply_chat_template(tokenize=True)`:
    /// no special tokens added beyond the template's) and, per token, whether it is the assistant's (see the
    /// module doc). Fails when the template renders an earlier turn differently once later ones follow.
    pub fn encode(&self, tok: &Tokenizer, messages: &[Value]) -> Result<(Vec<u32>, Vec<bool>)> {
        let c = self.encode_conversation(tok, messages)?;
        Ok((c.ids, c.trained))
    }

    /// [`encode`](Self::encode), with the lengths of the conversation's opening and of the template's start
    /// (what a window keeps when a conversation longer than it is cut on the left).
    pub fn encode_conversation(&self, tok: &Tokenizer, messages: &[Value]) -> Result<EncodedConversation> {
        let full = self.render(messages, false)?;
        let mut spans = Vec::new();
        for (i, m) in messages.iter().enumerate() {
            if m.get("role").and_then(Value::as_str) != Some("assistant") {
                continue;
            }
            let before = self.render(&messages[..i], true)?;
            let upto = self.render(&messages[..=i], false)?;
            if !upto.starts_with(&before) || !full.starts_with(&upto) {
                return Err(Error::Tokenizer {
                    source_name: "the model's chat template".into(),
                    message: format!(
                        "it renders turn {} differently once later turns follow (some templates, like Qwen3's, drop \
                         earlier reasoning), so the assistant's tokens cannot be told apart; train on --data as plain \
                         text instead",
                        i + 1
                    ),
                });
            }
            spans.push((before.len(), upto.len()));
        }
        let enc = tok
            .encode(full.as_str(), false)
            .map_err(|e| Error::Tokenizer { source_name: "encode".into(), message: e.to_string() })?;
        let offsets = enc.get_offsets();
        let trained = offsets.iter().map(|&(s, e)| spans.iter().any(|&(a, b)| s < b && e > a)).collect();
        let start_chars = self.start_of(&full);
        let opening_chars = self.opening_of(messages, &full).max(start_chars);
        // Whole tokens only: those that end within the text.
        let tokens_within = |chars: usize| offsets.iter().take_while(|&&(_, e)| e <= chars).count();
        Ok(EncodedConversation {
            ids: enc.get_ids().to_vec(),
            trained,
            opening: tokens_within(opening_chars),
            start: tokens_within(start_chars),
        })
    }

    /// The length of the template's own start in `full` (a rendered conversation): what it renders for no
    /// messages when `full` begins with that, else its BOS text when `full` begins with it, else 0.
    fn start_of(&self, full: &str) -> usize {
        match self.render(&[], false) {
            Ok(empty) if !empty.is_empty() && full.starts_with(&empty) => empty.len(),
            _ if !self.bos_token.is_empty() && full.starts_with(&self.bos_token) => self.bos_token.len(),
            _ => 0,
        }
    }

    /// The length of what `full` (the rendering of `messages`) holds before the first non-system message's
    /// content: the part it shares with the rendering of the conversation with that content emptied (0 when
    /// that does not render).
    fn opening_of(&self, messages: &[Value], full: &str) -> usize {
        let Some(j) = messages.iter().position(|m| m.get("role").and_then(Value::as_str) != Some("system")) else {
            return 0;
        };
        let mut probe = messages.to_vec();
        if let Some(m) = probe[j].as_object_mut() {
            m.insert("content".into(), Value::String(String::new()));
        }
        let Ok(other) = self.render(&probe, false) else { return 0 };
        let mut common = 0;
        for ((i, a), b) in full.char_indices().zip(other.chars()) {
            if a != b {
                break;
            }
            common = i + a.len_utf8();
        }
        common
    }
}

/// A conversation rendered and tokenised by [`ChatTemplate::encode_conversation`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EncodedConversation {
    /// Its token ids.
    pub ids: Vec<u32>,
    /// Per token, whether it is the assistant's (trains).
    pub trained: Vec<bool>,
    /// How many leading tokens are its opening: everything rendered before the first non-system message's
    /// content (the template's start, the system turn, the conversation's or the template's default, and that
    /// message's header). Never fewer than `start`.
    pub opening: usize,
    /// How many leading tokens are the template's own start (its BOS, or what it renders for no messages).
    pub start: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags_are_dropped_and_errors_raised() {
        let t = "{% for m in messages %}{%- generation -%}{{ m.content }}{% endgeneration %}{% endfor %}";
        assert_eq!(without_generation_tags(t), "{% for m in messages %}{{ m.content }}{% endfor %}");
        let c = ChatTemplate::new("{{ raise_exception('no system role') }}", "", "").unwrap();
        let e = c.render(&[], false).unwrap_err().to_string();
        assert!(e.contains("no system role"), "{e}");
        let c =
            ChatTemplate::new("{{ bos_token }}{{ messages[0]['content'].strip() | upper }}", "<s>", "</s>").unwrap();
        let m = serde_json::json!([{"role": "user", "content": "  hi "}]);
        assert_eq!(c.render(m.as_array().unwrap(), false).unwrap(), "<s>HI");
    }
}
