//go:build windows

package sqllock

import (
	"errors"
	"os"

	"golang.org/x/sys/windows"
)

// TryLockFile takes an exclusive lock on the first byte of f without waiting; held is false
// when another open handle, in this process or another, holds it.
func TryLockFile(f *os.File) (held bool, err error) {
	err = windows.LockFileEx(windows.Handle(f.Fd()), windows.LOCKFILE_EXCLUSIVE_LOCK|windows.LOCKFILE_FAIL_IMMEDIATELY,
		0, 1, 0, new(windows.Overlapped))
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, windows.ERROR_LOCK_VIOLATION):
		return false, nil
	}
	return false, err
}

// UnlockFile releases the lock TryLockFile took on f.
func UnlockFile(f *os.File) error {
	return windows.UnlockFileEx(windows.Handle(f.Fd()), 0, 1, 0, new(windows.Overlapped))
}
