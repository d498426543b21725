//go:build !windows

package sqllock

import (
	"errors"
	"os"

	"golang.org/x/sys/unix"
)

// TryLockFile takes an exclusive flock on f without waiting; held is false when another open
// file, in this process or another, holds it.
func TryLockFile(f *os.File) (held bool, err error) {
	for {
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		switch {
		case err == nil:
			return true, nil
		case errors.Is(err, unix.EWOULDBLOCK):
			return false, nil
		case errors.Is(err, unix.EINTR):
			continue
		}
		return false, err
	}
}

// UnlockFile releases the lock TryLockFile took on f.
func UnlockFile(f *os.File) error { return unix.Flock(int(f.Fd()), unix.LOCK_UN) }
