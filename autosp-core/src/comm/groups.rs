//! Subgroup layouts for `ProcessGroup::split`: checking that a list of groups partitions the ranks, and the
//! two layouts of a 2D (hybrid) grid of `P = u * r` ranks.

use super::error::{CommError, Result};

/// `size / u` groups of `u` consecutive ranks: `[[0, .., u-1], [u, .., 2u-1], ..]` (the Ulysses groups of a
/// hybrid layout). Errors unless `u` divides `size`.
pub fn contiguous_groups(size: usize, u: usize) -> Result<Vec<Vec<usize>>> {
    check_grid(size, u)?;
    Ok((0..size / u).map(|g| (g * u..(g + 1) * u).collect()).collect())
}

/// `u` groups of the ranks with equal position in their contiguous group: `[[0, u, 2u, ..], [1, u+1, ..], ..]`
/// (the Ring groups orthogonal to `contiguous_groups(size, u)`). Errors unless `u` divides `size`.
pub fn strided_groups(size: usize, u: usize) -> Result<Vec<Vec<usize>>> {
    check_grid(size, u)?;
    Ok((0..u).map(|i| (0..size / u).map(|g| g * u + i).collect()).collect())
}

fn check_grid(size: usize, u: usize) -> Result<()> {
    if u == 0 || size == 0 || !size.is_multiple_of(u) {
        return Err(CommError::Config {
            detail: format!("a grid of {size} ranks needs an inner group size u that divides it, got u = {u}"),
        });
    }
    Ok(())
}

/// Checks that `groups` partition `0..size` and returns `(g, i)`: `rank` is `groups[g][i]`.
pub(crate) fn locate(groups: &[Vec<usize>], size: usize, rank: usize) -> Result<(usize, usize), String> {
    let mut seen = vec![false; size];
    for (g, members) in groups.iter().enumerate() {
        if members.is_empty() {
            return Err(format!("group {g} is empty"));
        }
        for &m in members {
            if m >= size {
                return Err(format!("group {g} names rank {m}, but the group has {size} ranks"));
            }
            if seen[m] {
                return Err(format!("rank {m} appears in more than one place in {groups:?}"));
            }
            seen[m] = true;
        }
    }
    if let Some(m) = seen.iter().position(|s| !s) {
        return Err(format!("rank {m} is in no group of {groups:?}; the groups must cover every rank 0..{size}"));
    }
    for (g, members) in groups.iter().enumerate() {
        if let Some(i) = members.iter().position(|&m| m == rank) {
            return Ok((g, i));
        }
    }
    unreachable!("every rank was seen in some group")
}

/// The group list as integers `[G, len_0, members_0.., len_1, members_1.., ..]`, to compare across ranks.
pub(crate) fn encode(groups: &[Vec<usize>]) -> Vec<i64> {
    let mut out = vec![groups.len() as i64];
    for members in groups {
        out.push(members.len() as i64);
        out.extend(members.iter().map(|&m| m as i64));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_layouts_of_eight_ranks() {
        assert_eq!(contiguous_groups(8, 2).unwrap(), vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]);
        assert_eq!(strided_groups(8, 2).unwrap(), vec![vec![0, 2, 4, 6], vec![1, 3, 5, 7]]);
        assert!(contiguous_groups(6, 4).is_err());
        assert!(strided_groups(6, 0).is_err());
    }

    #[test]
    fn locate_checks_the_partition() {
        let g = vec![vec![2, 0], vec![1, 3]];
        assert_eq!(locate(&g, 4, 0), Ok((0, 1)));
        assert_eq!(locate(&g, 4, 3), Ok((1, 1)));
        assert!(locate(&[vec![0, 1], vec![1, 2]], 3, 0).is_err());
        assert!(locate(&[vec![0, 1]], 3, 0).unwrap_err().contains("rank 2 is in no group"));
        assert!(locate(&[vec![0, 5]], 2, 0).is_err());
        assert!(locate(&[vec![0, 1], vec![]], 2, 0).is_err());
    }

    #[test]
    fn encoding_distinguishes_layouts() {
        assert_eq!(encode(&[vec![0, 1], vec![2]]), vec![2, 2, 0, 1, 1, 2]);
        assert_ne!(encode(&[vec![0, 1], vec![2]]), encode(&[vec![0], vec![1, 2]]));
    }
}
