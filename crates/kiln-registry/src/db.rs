//! The registry database: one row per model found (a GGUF file or a model
//! directory, per hub snapshot), plus the folders `kiln scan` was given.

use std::path::{Path, PathBuf};

use rusqlite::{params, Connection, OptionalExtension, Row};

use crate::error::{RegistryError, Result};
use crate::find::Found;
use crate::inspect::{Capabilities, ModelFormat, ModelInfo};

/// Where a model lives: the hub cache (whose files `kiln rm --delete-files`
/// may delete) or anywhere else (never deleted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    HubCache,
    Local,
}

impl Source {
    pub fn name(self) -> &'static str {
        match self {
            Source::HubCache => "hub-cache",
            Source::Local => "local",
        }
    }
}

/// One registered model: where it was found and what its headers say.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub found: Found,
    /// `None` when its headers could not be read (see `problem`).
    pub info: Option<ModelInfo>,
    /// Why the model could not be (fully) read.
    pub problem: Option<String>,
}

impl Entry {
    /// The support tier: the Kiln family, `unsupported`, or `unreadable`.
    pub fn tier(&self) -> &str {
        match &self.info {
            Some(i) => i.family.as_deref().unwrap_or("unsupported"),
            None => "unreadable",
        }
    }
}

/// Bumped when the tables change; an older database is rebuilt (it holds
/// only what a scan finds again).
const SCHEMA_VERSION: i64 = 1;

const SCHEMA: &str = "
CREATE TABLE models (
    path TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    repo TEXT,
    revision TEXT,
    refs TEXT NOT NULL,
    source TEXT NOT NULL,
    modified INTEGER NOT NULL,
    format TEXT,
    architecture TEXT,
    model_type TEXT,
    num_params INTEGER,
    quant TEXT,
    context_length INTEGER,
    size_bytes INTEGER,
    tools INTEGER,
    thinking INTEGER,
    vision INTEGER,
    audio INTEGER,
    family TEXT,
    problem TEXT
);
CREATE TABLE roots (path TEXT PRIMARY KEY);
";

/// The registry: a SQLite file (or memory, for tests).
pub struct Registry {
    conn: Connection,
    path: PathBuf,
}

impl Registry {
    /// Open (creating it and its folder if needed) the database at `path`.
    pub fn open(path: &Path) -> Result<Registry> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|source| RegistryError::Io {
                path: parent.to_path_buf(),
                source,
            })?;
        }
        let conn = Connection::open(path).map_err(|source| RegistryError::Db {
            path: path.to_path_buf(),
            source,
        })?;
        Registry::init(conn, path.to_path_buf())
    }

    /// A registry that lives in memory only.
    pub fn in_memory() -> Result<Registry> {
        let path = PathBuf::from(":memory:");
        let conn = Connection::open_in_memory().map_err(|source| RegistryError::Db {
            path: path.clone(),
            source,
        })?;
        Registry::init(conn, path)
    }

    fn db_err(&self, source: rusqlite::Error) -> RegistryError {
        RegistryError::Db {
            path: self.path.clone(),
            source,
        }
    }

    fn init(conn: Connection, path: PathBuf) -> Result<Registry> {
        let reg = Registry { conn, path };
        let version: i64 = reg
            .conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(|e| reg.db_err(e))?;
        if version != SCHEMA_VERSION {
            let sql = format!(
                "DROP TABLE IF EXISTS models; DROP TABLE IF EXISTS roots; {SCHEMA} PRAGMA user_version = {SCHEMA_VERSION};"
            );
            reg.conn.execute_batch(&sql).map_err(|e| reg.db_err(e))?;
        }
        Ok(reg)
    }

    /// Remember `path` as a place `kiln scan` looks.
    pub fn add_root(&self, path: &Path) -> Result<()> {
        self.conn
            .execute(
                "INSERT OR IGNORE INTO roots (path) VALUES (?1)",
                [path.to_string_lossy()],
            )
            .map_err(|e| self.db_err(e))?;
        Ok(())
    }

    pub fn remove_root(&self, path: &Path) -> Result<()> {
        self.conn
            .execute(
                "DELETE FROM roots WHERE path = ?1",
                [path.to_string_lossy()],
            )
            .map_err(|e| self.db_err(e))?;
        Ok(())
    }

    pub fn roots(&self) -> Result<Vec<PathBuf>> {
        let mut st = self
            .conn
            .prepare("SELECT path FROM roots ORDER BY path")
            .map_err(|e| self.db_err(e))?;
        let rows = st
            .query_map([], |r| r.get::<_, String>(0))
            .map_err(|e| self.db_err(e))?;
        rows.map(|r| r.map(PathBuf::from).map_err(|e| self.db_err(e)))
            .collect()
    }

    /// Insert or replace the row of `entry.found.path`.
    pub fn upsert(&self, entry: &Entry) -> Result<()> {
        let f = &entry.found;
        let i = entry.info.as_ref();
        let caps = i.map(|i| i.capabilities);
        self.conn
            .execute(
                "INSERT OR REPLACE INTO models (path, name, repo, revision, refs, source, modified,
                    format, architecture, model_type, num_params, quant, context_length, size_bytes,
                    tools, thinking, vision, audio, family, problem)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20)",
                params![
                    f.path.to_string_lossy(),
                    f.name,
                    f.repo,
                    f.revision,
                    f.refs.join(","),
                    f.source.name(),
                    f.modified,
                    i.map(|i| i.format.name()),
                    i.map(|i| i.architecture.clone()),
                    i.map(|i| i.model_type.clone()),
                    i.and_then(|i| i.num_params).map(|n| n as i64),
                    i.map(|i| i.quant.clone()),
                    i.and_then(|i| i.context_length).map(|n| n as i64),
                    i.map(|i| i.size_bytes as i64),
                    caps.map(|c| c.tools),
                    caps.map(|c| c.thinking),
                    caps.map(|c| c.vision),
                    caps.map(|c| c.audio),
                    i.and_then(|i| i.family.clone()),
                    entry.problem.clone().or_else(|| i.and_then(|i| i.problem.clone())),
                ],
            )
            .map_err(|e| self.db_err(e))?;
        Ok(())
    }

    /// Forget the model at `path`. Returns whether there was one.
    pub fn remove(&self, path: &Path) -> Result<bool> {
        let n = self
            .conn
            .execute(
                "DELETE FROM models WHERE path = ?1",
                [path.to_string_lossy()],
            )
            .map_err(|e| self.db_err(e))?;
        Ok(n > 0)
    }

    /// The entry at `path`, if registered.
    pub fn get(&self, path: &Path) -> Result<Option<Entry>> {
        self.conn
            .query_row(
                "SELECT * FROM models WHERE path = ?1",
                [path.to_string_lossy()],
                row_to_entry,
            )
            .optional()
            .map_err(|e| self.db_err(e))
    }

    /// Every entry, ordered by name then path.
    pub fn entries(&self) -> Result<Vec<Entry>> {
        let mut st = self
            .conn
            .prepare("SELECT * FROM models ORDER BY name COLLATE NOCASE, path")
            .map_err(|e| self.db_err(e))?;
        let rows = st.query_map([], row_to_entry).map_err(|e| self.db_err(e))?;
        rows.map(|r| r.map_err(|e| self.db_err(e))).collect()
    }
}

fn row_to_entry(r: &Row<'_>) -> rusqlite::Result<Entry> {
    let refs: String = r.get("refs")?;
    let source: String = r.get("source")?;
    let found = Found {
        path: PathBuf::from(r.get::<_, String>("path")?),
        name: r.get("name")?,
        repo: r.get("repo")?,
        revision: r.get("revision")?,
        refs: refs
            .split(',')
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect(),
        source: if source == "hub-cache" {
            Source::HubCache
        } else {
            Source::Local
        },
        modified: r.get("modified")?,
    };
    let format: Option<String> = r.get("format")?;
    let problem: Option<String> = r.get("problem")?;
    let info = match format.as_deref().and_then(ModelFormat::from_name) {
        None => None,
        Some(format) => Some(ModelInfo {
            format,
            architecture: r
                .get::<_, Option<String>>("architecture")?
                .unwrap_or_default(),
            model_type: r
                .get::<_, Option<String>>("model_type")?
                .unwrap_or_default(),
            num_params: r.get::<_, Option<i64>>("num_params")?.map(|n| n as u64),
            quant: r.get::<_, Option<String>>("quant")?.unwrap_or_default(),
            context_length: r.get::<_, Option<i64>>("context_length")?.map(|n| n as u64),
            size_bytes: r.get::<_, Option<i64>>("size_bytes")?.unwrap_or(0) as u64,
            capabilities: Capabilities {
                tools: r.get::<_, Option<bool>>("tools")?.unwrap_or(false),
                thinking: r.get::<_, Option<bool>>("thinking")?.unwrap_or(false),
                vision: r.get::<_, Option<bool>>("vision")?.unwrap_or(false),
                audio: r.get::<_, Option<bool>>("audio")?.unwrap_or(false),
            },
            family: r.get("family")?,
            problem: problem.clone(),
        }),
    };
    Ok(Entry {
        found,
        problem: if info.is_none() { problem } else { None },
        info,
    })
}
