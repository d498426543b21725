// Package connect holds the one definition of the connect timeout that sqldb.Open and
// broker.Open share: its URL parameter, its default and how its value is written.
package connect

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"
)

// Param is the URL query parameter that bounds a connect.
const Param = "connect_timeout"

// DefaultTimeout bounds a connect when the URL has no Param.
const DefaultTimeout = 10 * time.Second

// ParseTimeout reads the value of Param: a Go duration (300ms, 10s) or, as libpq writes it,
// whole seconds (10). It is not negative; 0 means no limit.
func ParseTimeout(v string) (time.Duration, error) {
	d, err := time.ParseDuration(v)
	if err != nil {
		n, nerr := strconv.ParseInt(v, 10, 32)
		if nerr != nil {
			return 0, fmt.Errorf("query parameter %s=%q: want a Go duration such as 10s or 300ms, or whole seconds", Param, v)
		}
		d = time.Duration(n) * time.Second
	}
	if d < 0 {
		return 0, fmt.Errorf("query parameter %s=%q: want a duration that is not negative (0 waits without limit)", Param, v)
	}
	return d, nil
}

// TimeoutError is the error of a connect that the connect timeout ended. It says so, and
// wraps the client's error, which names the address.
type TimeoutError struct {
	Timeout time.Duration
	Err     error
}

func (e *TimeoutError) Error() string {
	return fmt.Sprintf("no answer within %s (%s): %v", e.Timeout, Param, e.Err)
}

func (e *TimeoutError) Unwrap() error { return e.Err }

// Explain returns err, returned by a connect that was given timeout, as a TimeoutError when the
// timeout ran out: err is a deadline or a network timeout and the caller's own context, parent,
// has not ended. Any other err, and an err that is a TimeoutError already, is returned as it is.
func Explain(parent context.Context, timeout time.Duration, err error) error {
	var te *TimeoutError
	if err == nil || timeout <= 0 || parent.Err() != nil || errors.As(err, &te) || !isTimeout(err) {
		return err
	}
	return &TimeoutError{Timeout: timeout, Err: err}
}

// isTimeout reports a context deadline or a network timeout (an I/O deadline, which some
// clients set from the connect timeout instead of a context).
func isTimeout(err error) bool {
	if errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	var t interface{ Timeout() bool }
	return errors.As(err, &t) && t.Timeout()
}
