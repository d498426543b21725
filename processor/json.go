package processor

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"

	"github.com/onceflow/onceflow/messagedata"
)

// JSON returns a Processor that decodes the payload into a T and calls fn with it.
//
// A payload that is not one JSON value decoding into T is a permanent error: redelivering it
// cannot help, so the message goes to the dead-letter topic with the decoding error as its
// reason. Fields that T does not declare are ignored, so producers may add fields first.
func JSON[T any](fn func(ctx context.Context, msg *messagedata.MessageData, v T) error) Processor {
	return Func(func(ctx context.Context, msg *messagedata.MessageData) error {
		var v T
		if err := decodeStrict(msg.Payload, &v); err != nil {
			return Permanent(fmt.Errorf("decode JSON payload of message %q into %T: %w", msg.ID, v, err))
		}
		return fn(ctx, msg, v)
	})
}

func decodeStrict(payload []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(payload))
	if err := dec.Decode(v); err != nil {
		return err
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return errors.New("trailing data after the JSON value")
	}
	return nil
}
