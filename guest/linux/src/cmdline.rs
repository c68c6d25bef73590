//! The guest command line of a Linux program:
//! `RUNTIME-OPTIONS -- [NAME=VALUE...] PROGRAM ARGS...`, split into words
//! the way a shell would (single quotes, double quotes with `\"` and `\\`,
//! backslash escapes), so `--save ''` passes an empty argument. Words after
//! `--` that contain `=` before the program name are its environment, as
//! with env(1).

use alloc::string::String;
use alloc::vec::Vec;

#[derive(Debug, Default, PartialEq, Eq)]
pub struct Command {
    /// Words before `--`, for the runtime (`ip=`, `gw=`, ...).
    pub options: Vec<String>,
    pub env: Vec<String>,
    pub argv: Vec<String>,
}

pub fn split(line: &str) -> Result<Vec<String>, &'static str> {
    let mut words = Vec::new();
    let mut word: Option<String> = None;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            c if c.is_ascii_whitespace() => words.extend(word.take()),
            '\'' => {
                let w = word.get_or_insert_with(String::new);
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(c) => w.push(c),
                        None => return Err("unterminated single quote"),
                    }
                }
            }
            '"' => {
                let w = word.get_or_insert_with(String::new);
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(c @ ('"' | '\\' | '$' | '`')) => w.push(c),
                            Some(c) => {
                                w.push('\\');
                                w.push(c);
                            }
                            None => return Err("unterminated double quote"),
                        },
                        Some(c) => w.push(c),
                        None => return Err("unterminated double quote"),
                    }
                }
            }
            '\\' => word.get_or_insert_with(String::new).push(chars.next().ok_or("trailing backslash")?),
            c => word.get_or_insert_with(String::new).push(c),
        }
    }
    words.extend(word);
    Ok(words)
}

pub fn parse(line: &str) -> Result<Command, &'static str> {
    let words = split(line)?;
    let sep = words.iter().position(|w| w == "--").ok_or("no program: the command line is RUNTIME-OPTIONS -- PROGRAM ARGS...")?;
    let mut cmd = Command { options: words[..sep].to_vec(), ..Command::default() };
    let mut rest = words[sep + 1..].iter();
    for w in rest.by_ref() {
        if w.contains('=') && cmd.argv.is_empty() {
            cmd.env.push(w.clone());
        } else {
            cmd.argv.push(w.clone());
            break;
        }
    }
    cmd.argv.extend(rest.cloned());
    if cmd.argv.is_empty() {
        return Err("no program name after --");
    }
    Ok(cmd)
}
