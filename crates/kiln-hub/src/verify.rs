//! Hashing a blob while it streams in: sha256 for LFS files, the git blob
//! sha1 (`sha1("blob {size}\0" + bytes)`) for files kept in git.

use sha1::{Digest, Sha1};
use sha2::Sha256;

use crate::info::Etag;

/// The running hash a blob's bytes must end at.
pub(crate) enum BlobHasher {
    Sha256(Sha256),
    GitSha1(Sha1),
}

impl BlobHasher {
    /// A hasher for a blob of `size` bytes named by `etag`.
    pub(crate) fn new(etag: &Etag, size: u64) -> BlobHasher {
        match etag {
            Etag::Sha256(_) => BlobHasher::Sha256(Sha256::new()),
            Etag::GitSha1(_) => {
                let mut h = Sha1::new();
                h.update(format!("blob {size}\0").as_bytes());
                BlobHasher::GitSha1(h)
            }
        }
    }

    pub(crate) fn update(&mut self, bytes: &[u8]) {
        match self {
            BlobHasher::Sha256(h) => h.update(bytes),
            BlobHasher::GitSha1(h) => h.update(bytes),
        }
    }

    /// The lowercase hex digest.
    pub(crate) fn finish(self) -> String {
        let bytes: Vec<u8> = match self {
            BlobHasher::Sha256(h) => h.finalize().to_vec(),
            BlobHasher::GitSha1(h) => h.finalize().to_vec(),
        };
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(etag: &Etag, bytes: &[u8]) -> String {
        let mut h = BlobHasher::new(etag, bytes.len() as u64);
        h.update(bytes);
        h.finish()
    }

    #[test]
    fn matches_git_and_sha256sum() {
        // `git hash-object /dev/null` and `printf 'hello\n' | git hash-object --stdin`.
        let git = Etag::GitSha1(String::new());
        assert_eq!(
            digest(&git, b""),
            "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"
        );
        assert_eq!(
            digest(&git, b"hello\n"),
            "ce013625030ba8dba906f756967f9e9ca394464a"
        );
        let lfs = Etag::Sha256(String::new());
        assert_eq!(
            digest(&lfs, b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
